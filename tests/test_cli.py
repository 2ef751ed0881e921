"""The `hfexport` command: the README's quick-start export, offline, with a manifest and a report."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hfexport.cli import main


def test_export_builtin_tiny_model_writes_artifact_manifest_and_report(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert main(["export", "--model", "tiny-llama", "--format", "dynamo", "--output", str(out), "--validate"]) == 0
    assert {p.name for p in out.iterdir()} == {"model.pt2", "manifest.json", "report.json"}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "dynamo" and manifest["inputs"] == ["input_ids", "attention_mask"]
    assert manifest["config"]["export_format"] == "dynamo" and manifest["config"]["dynamic"] is True
    report = json.loads((out / "report.json").read_text())
    assert report["model_class"] == "LlamaForCausalLM"
    assert "LlamaForCausalLM -> dynamo" in capsys.readouterr().out
    # the artifact loads in a fresh process and runs another shape
    script = f"""
import torch
from hfexport import load_program
program = load_program({str(out / "model.pt2")!r})
ids = torch.randint(3, 128, (3, 5))
print(tuple(program.module()(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.shape))
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "(3, 5, 128)" in result.stdout


def test_export_refuses_a_non_empty_output_without_overwrite(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("x")
    with pytest.raises(SystemExit, match="--overwrite"):
        main(["export", "--model", "tiny-llama", "--output", str(tmp_path)])
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_unknown_model_and_format_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="built-in"):
        main(["export", "--model", "no-such-model", "--output", str(tmp_path / "a")])
    with pytest.raises(ValueError, match="unknown export_format"):
        main(["export", "--model", "tiny-llama", "--format", "tflite", "--output", str(tmp_path / "b")])


def test_rules_list_prints_every_rule(capsys) -> None:
    from hfexport.rewrites.engine import default_registry

    assert main(["rules", "list"]) == 0
    printed = capsys.readouterr().out
    for rule in default_registry().rules():
        assert rule.id in printed
    assert f"{len(default_registry().rules())} rule(s)" in printed
