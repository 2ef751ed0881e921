"""The built-in tiny models: every one builds offline from its config, deterministically, and runs eager; the
encoder-decoder and multimodal ones export through the command line as one graph."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hfexport.tiny import TINY_MODELS, get_tiny_model

REQUIRED = ["tiny-llama", "tiny-qwen3-moe", "tiny-mamba", "tiny-t5", "tiny-llava", "tiny-whisper", "tiny-gpt2"]
ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}


@pytest.mark.parametrize("name", REQUIRED)
def test_builtin_tiny_model_builds_from_config_and_runs_eager_deterministically(name: str) -> None:
    tiny = get_tiny_model(name)
    model, again = tiny.build(), tiny.build()
    inputs = tiny.sample_inputs()
    assert all(torch.equal(inputs[k], v) for k, v in tiny.sample_inputs().items()), "inputs are seeded"
    assert not model.training and sum(p.numel() for p in model.parameters()) < 500_000
    with torch.no_grad():
        logits, logits_again = model(**inputs).logits, again(**inputs).logits
    assert torch.equal(logits, logits_again), "weights are seeded"
    assert logits.shape[0] == 2 and torch.isfinite(logits).all()


def test_unknown_tiny_model_lists_the_builtins() -> None:
    with pytest.raises(KeyError, match="tiny-whisper"):
        get_tiny_model("tiny-nope")
    assert set(REQUIRED) <= set(TINY_MODELS)


@pytest.mark.slow  # tests/test_cli_matrix.py runs the same commands in the default tier
@pytest.mark.parametrize(
    "name",
    [
        "tiny-t5",
        pytest.param("tiny-whisper", marks=pytest.mark.slow),
        pytest.param("tiny-llava", marks=pytest.mark.slow),
    ],
)
def test_seq2seq_and_multimodal_tiny_models_export_and_validate_from_the_command_line(
    name: str, tmp_path: Path
) -> None:
    out = tmp_path / name
    result = subprocess.run(
        [sys.executable, "-m", "hfexport", "export", "--model", name, "--output", str(out), "--validate"],
        capture_output=True,
        text=True,
        env=ENV,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["inputs"] == list(TINY_MODELS[name].sample_inputs())
    assert manifest["validation"]["ok"] is True and "ok   logits" in result.stdout
