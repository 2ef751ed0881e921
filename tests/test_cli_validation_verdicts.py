"""A failed or crashed validation is never success (docs/cli.md, "When a validation fails"), exit codes do not
depend on `--debug`, and the default tolerance follows the weights' dtype.

Every command runs for real in a subprocess; the tests assert its exit code, the first line of its stderr and
the files it leaves behind.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import hfexport
from hfexport.artifacts import FailedValidationWarning, update_manifest
from hfexport.cli.validation import crashed

ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}
ENV.pop("HFEXPORT_DEBUG", None)


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hfexport", *args], capture_output=True, text=True, env=ENV, timeout=1200
    )


def _first(stream: str) -> str:
    return (stream.splitlines() or [""])[0]


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def test_a_failed_validation_keeps_the_artifact_marked_failed_and_check_and_load_say_so(tmp_path: Path) -> None:
    out = tmp_path / "out"
    # A zero tolerance: ONNX Runtime's sums differ from eager's in the last bits.
    result = _run(
        "export", "--model", "tiny-llama", "--format", "onnx", "--output", str(out), "--validate",
        "--atol", "0", "--rtol", "0",
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-3000:]
    assert _first(result.stderr) == "• building tiny-llama"
    lines = result.stderr.splitlines()
    failed = lines.index("validation failed: the artifact differs from eager beyond the tolerance")
    assert lines[failed + 1].startswith(f"the artifact is kept in {out}/ with its manifest saying validation failed")
    assert "--overwrite" in lines[failed + 1] and "Traceback" not in result.stderr
    assert result.stdout.rstrip().splitlines()[-1].startswith("FAILED in ")
    # Kept whole, marked failed, with the tolerance it was held to.
    manifest = _manifest(out)
    assert sorted(p.name for p in out.iterdir()) == sorted([*manifest["files"], "manifest.json"])
    validation = manifest["validation"]
    assert validation["ok"] is False and validation["tolerance_source"] == "--atol and --rtol"
    assert (validation["atol"], validation["rtol"]) == (0.0, 0.0)

    # `check` reports it and exits 1 (the files are fine: 4 is for a refused artifact).
    check = _run("check", str(out))
    assert check.returncode == 1, check.stderr
    assert _first(check.stdout) == f"{out}: onnx artifact of LlamaForCausalLM, files ok, validation FAILED"
    assert _first(check.stderr).startswith(f"error: {out}: its validation failed when it was exported: differs on ")
    # Python: load and from_pretrained warn.
    with pytest.warns(FailedValidationWarning, match="its validation failed when it was exported"):
        hfexport.load(out)
    with pytest.warns(FailedValidationWarning):
        hfexport.AutoExportedModel.from_pretrained(out)

    # The same command again is refused before any work, naming --overwrite.
    again = _run("export", "--model", "tiny-llama", "--format", "onnx", "--output", str(out), "--validate")
    assert again.returncode == 2 and _first(again.stderr).startswith(f"error: {out} exists and is not empty")
    assert "(--overwrite)" in _first(again.stderr)

    # A validation that could not run is recorded with its error: check names it, load warns.
    update_manifest(out, validation=crashed(KeyError("input_ids")))
    check = _run("check", str(out))
    assert check.returncode == 1
    assert _first(check.stderr).endswith("the validation could not run: KeyError: 'input_ids'")
    with pytest.warns(FailedValidationWarning, match="could not run"):
        hfexport.load(out)


@pytest.mark.slow
def test_check_says_when_an_artifact_was_not_validated(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = _run("export", "--model", "tiny-gpt2", "--format", "onnx", "--output", str(out))
    assert result.returncode == 0 and _manifest(out)["validation"] is None
    check = _run("check", str(out))
    assert check.returncode == 0 and "  validation: not run: exported without --validate" in check.stdout
    with warnings.catch_warnings():
        warnings.simplefilter("error", FailedValidationWarning)
        hfexport.load(out)  # nothing to warn about


@pytest.mark.slow
def test_the_exit_code_does_not_depend_on_debug(tmp_path: Path) -> None:
    # A folder whose weight has another shape than its config says: transformers refuses it while loading, an
    # unexpected error, exit 3 (a config transformers cannot read is refused earlier, as a usage error).
    from safetensors.torch import save_file

    from tests.test_cli_errors import SMALL_LLAMA

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(SMALL_LLAMA))
    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, str(folder / "model.safetensors"))
    args = ("export", "--model", str(folder), "--output", str(tmp_path / "out"))
    plain, debug = _run(*args), _run(*args, "--debug")
    assert plain.returncode == debug.returncode == 3, (plain.stderr[-2000:], debug.stderr[-2000:])
    assert _first(plain.stderr) == _first(debug.stderr) == f"• building {folder}"
    line = plain.stderr.splitlines()[-1]
    assert line.startswith("error: RuntimeError: ") and line.endswith(" (--debug shows the traceback)")
    assert "Traceback (most recent call last):" in debug.stderr and "Traceback" not in plain.stderr
    assert debug.stderr.splitlines()[-1] == line.removesuffix(" (--debug shows the traceback)")
    assert not (tmp_path / "out").exists()


def test_a_bfloat16_export_is_held_to_the_bfloat16_tolerance(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = _run("export", "--model", "tiny-llama", "--dtype", "bf16", "--format", "onnx", "--output", str(out),
                  "--validate")  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert _first(result.stderr) == "• building tiny-llama"
    assert "|diff| <= atol 0.0001 + rtol 0.02 * max|eager|: the default for bfloat16 weights):" in result.stdout
    validation = _manifest(out)["validation"]
    assert validation["ok"] is True and validation["rtol"] == 0.02
    assert validation["tolerance_source"] == "the default for bfloat16 weights"
    # bfloat16 eager is itself a bfloat16 step or so from what ONNX Runtime computes: the diff is not zero.
    assert 0 < max(o["max_abs_diff"] for o in validation["outputs"]) < 0.02
