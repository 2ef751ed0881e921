"""NNCF's Torch FX weight compression (`NNCFTorchFXQuantizer(NNCFWeightCompressionConfig(...))`) on ExecuTorch and
OpenVINO, run in the real runtimes.

The compressed graph decompresses its integer weights before each linear; the rules
`executorch/quant-right-shift-verifier`, `executorch/quant-computed-weight-linear-untagged` and
`openvino/quant-right-shift-as-floor-scale` carry it through XNNPACK and `openvino.convert_model`. Each test
exports the random tiny Llama, runs the artifact on the sample and, for a dynamic export, on another shape, and
compares the logits with fp32 eager (cosine); the artifact must keep its weights as integer constants.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("nncf")

from hfexport import NNCFTorchFXQuantizer, NNCFWeightCompressionConfig
from hfexport.tiny import TINY_MODELS

TINY = TINY_MODELS["tiny-llama"]
# Measured 0.9987 (int4, group 16) and 0.99998 (int8) on the random tiny Llama; fp32 would be 1.0.
MIN_COSINE = 0.99


@pytest.fixture(scope="module")
def tiny() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    return TINY.build(), TINY.sample_inputs()


def _other_shape(seed: int = 5) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, TINY.config["vocab_size"], (3, 11), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _cosine(actual: Any, expected: torch.Tensor) -> float:
    actual = torch.as_tensor(np.asarray(actual)).flatten().double()
    assert torch.isfinite(actual).all()
    return torch.nn.functional.cosine_similarity(actual, expected.flatten().double(), dim=0).item()


def _eager(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def _hits(report: Any) -> dict[str, int]:
    return {rule.id: rule.hits for rule in report.rules if rule.hits}


def _quantizer(mode: str) -> NNCFTorchFXQuantizer:
    group = {"group_size": 16} if mode.startswith("int4") else {}
    return NNCFTorchFXQuantizer(NNCFWeightCompressionConfig(mode=mode, **group))


@pytest.mark.parametrize(
    ("mode", "dynamic"),
    [
        pytest.param("int4_sym", True, id="int4-dynamic", marks=pytest.mark.slow),  # 41 s: CI budget
        pytest.param("int8_asym", False, id="int8-static", marks=pytest.mark.slow),
        pytest.param("int4_asym", False, id="int4-asym-static", marks=pytest.mark.slow),
    ],
)
def test_nncf_weight_compression_on_executorch(tiny: Any, tmp_path: Path, mode: str, dynamic: bool) -> None:
    pytest.importorskip("executorch")
    from hfexport import ExecutorchConfig, ExecutorchExporter
    from hfexport.runtime.executorch import ExecutorchProgram

    model, inputs = tiny
    exporter = ExecutorchExporter()
    manager = exporter.export(model, inputs, ExecutorchConfig(dynamic=dynamic, quantizer=_quantizer(mode)))
    record, hits = exporter.report.quantization, _hits(exporter.report)
    assert record.op_counts.get("compressed_constant.uint8", 0) >= 14  # 7 linears in each of the 2 layers
    # Every decoder linear and the head decompress their weight in the graph.
    assert hits.get("executorch/quant-computed-weight-linear-untagged", 0) >= 14
    if mode.startswith("int4"):
        assert hits.get("executorch/quant-right-shift-verifier", 0) >= 14
    # The weights stay integer in the saved program.
    program = manager.exported_program("forward")
    integer = [v for v in program.state_dict.values() if v.dtype == torch.uint8 and v.ndim == 2]
    assert len(integer) >= 14
    path = tmp_path / "model.pte"
    manager.save(str(path))
    runtime = ExecutorchProgram(str(path))
    for feed in [inputs] + ([_other_shape()] if dynamic else []):
        assert _cosine(runtime.run(feed)[0], _eager(model, feed)) >= MIN_COSINE


@pytest.mark.slow
def test_nncf_fx_int4_on_openvino(tiny: Any) -> None:
    ov = pytest.importorskip("openvino")
    from hfexport import OpenVINOConfig, OpenVINOExporter

    model, inputs = tiny
    exporter = OpenVINOExporter()
    ov_model = exporter.export(model, inputs, OpenVINOConfig(dynamic=True, quantizer=_quantizer("int4_sym")))
    assert _hits(exporter.report).get("openvino/quant-right-shift-as-floor-scale", 0) >= 14
    # The packed int4 weights stay u8 constants in the OpenVINO model (not folded back to f32).
    packed = [
        op
        for op in ov_model.get_ops()
        if op.get_type_name() == "Constant"
        and op.get_output_element_type(0).get_type_name() == "u8"
        and len(op.get_output_shape(0)) == 2
    ]
    assert len(packed) >= 14
    compiled = ov.Core().compile_model(ov_model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    for feed in (inputs, _other_shape()):
        result = compiled({name: value.numpy() for name, value in feed.items()})
        assert _cosine(result[compiled.outputs[0]], _eager(model, feed)) >= MIN_COSINE
