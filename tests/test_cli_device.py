"""`hfexport export --device`: a device this machine lacks is refused in one line with exit code 2, before any
work; `cpu` works and is recorded with the validation. Each test runs the real command in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import onnxruntime
import pytest
import torch

ENV = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
ENV.pop("HFEXPORT_DEBUG", None)
HAS_CUDA = torch.cuda.is_available()
HAS_ORT_CUDA = "CUDAExecutionProvider" in onnxruntime.get_available_providers()


def _openvino_gpu() -> bool:
    import openvino as ov

    return any(d.startswith("GPU") for d in ov.Core().available_devices)


def _export(tmp_path: Path, *args: str) -> tuple[int, str, subprocess.CompletedProcess[str]]:
    result = subprocess.run(
        [sys.executable, "-m", "hfexport", "export", "--model", "tiny-llama", "--output", "out", *args],
        capture_output=True,
        text=True,
        env=ENV,
        cwd=tmp_path,
        timeout=900,
    )
    return result.returncode, (result.stderr.splitlines() or [""])[0], result


@pytest.mark.parametrize(
    ("args", "first_line"),
    [
        pytest.param(
            ["--format", "dynamo", "--device", "cuda"],
            "error: --device cuda: no CUDA device on this machine",
            marks=pytest.mark.skipif(HAS_CUDA, reason="this machine has CUDA"),
            id="dynamo-cuda",
        ),
        pytest.param(
            ["--format", "executorch", "--device", "cuda"],
            "error: --device cuda: no CUDA device on this machine",
            marks=pytest.mark.skipif(HAS_CUDA, reason="this machine has CUDA"),
            id="executorch-cuda",
        ),
        pytest.param(
            ["--format", "onnx", "--device", "cuda:0"],
            "error: --device cuda:0: this onnxruntime has no CUDAExecutionProvider (install onnxruntime-gpu)",
            marks=pytest.mark.skipif(HAS_ORT_CUDA, reason="onnxruntime has CUDA"),
            id="onnx-cuda",
        ),
        pytest.param(
            ["--format", "openvino", "--device", "gpu"],
            "error: --device gpu: OpenVINO sees no GPU here (devices: CPU)",
            marks=pytest.mark.skipif(_openvino_gpu(), reason="OpenVINO has a GPU here"),
            id="openvino-gpu",
        ),
        pytest.param(
            ["--format", "openvino", "--device", "cuda"],
            "error: --device cuda: OpenVINO has no CUDA device; its (Intel) GPU is --device gpu "
            "(--format openvino runs on cpu, gpu[.N])",
            id="openvino-cuda",
        ),
        pytest.param(
            ["--format", "onnx", "--device", "gpu"],
            "error: --device gpu: `gpu` names OpenVINO's GPU; a CUDA device is --device cuda",
            id="onnx-gpu",
        ),
        pytest.param(["--device", "tpu"], "error: --device tpu: not a device name", id="not-a-device"),
        pytest.param(
            ["--format", "executorch", "--device", "cpu", "--config", '{"backend": "cuda"}'],
            "error: --device cpu means backend 'xnnpack', --config says 'cuda': drop one",
            id="executorch-device-vs-config",
        ),
    ],
)
def test_unavailable_device_is_refused(tmp_path: Path, args: list[str], first_line: str) -> None:
    code, first, result = _export(tmp_path, *args)
    assert code == 2, result.stderr[-2000:]
    assert first.startswith(first_line), first
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr  # one line, no traceback, no progress
    assert not (tmp_path / "out").exists()


def test_cpu_device_validates(tmp_path: Path) -> None:
    code, first, result = _export(tmp_path, "--format", "onnx", "--device", "cpu", "--validate")
    assert code == 0, result.stderr[-3000:]
    assert first == "• building tiny-llama"
    assert "validating model.onnx in the onnx runtime on cpu against eager" in result.stderr
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["validation"]["ok"] and manifest["validation"]["device"] == "cpu"
