"""`export_for_generation` with every quantizer of the quantization table, on every backend it supports.

A tiny Llama with tied embeddings (the head reads the embedding's weight, as in SmolLM2 and Llama-3.2; the
vocabulary is large enough that the ONNX optimizer keeps the head's Transpose) is exported for generation with
each quantizer, prefill and decode both quantized, and `hfexport.runtime.generate` runs the components in
their runtime. The greedy tokens are compared with those of the fp32 export on the same backend: the
agreement is printed (random weights give near-flat logits, so a quantizer may flip a few argmaxes), and the
tokens must be valid ids that continue the prompt.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch

pytest.importorskip("nncf")
pytest.importorskip("torchao")

from hfexport import (
    AutoExportConfig,
    AutoHfExporter,
    NNCFOnnxQuantizer,
    NNCFOpenVINOQuantizer,
    NNCFQuantizationConfig,
    NNCFTorchFXQuantizer,
    NNCFWeightCompressionConfig,
    OnnxRuntimeDynamicConfig,
    OnnxRuntimeQuantizer,
    OnnxRuntimeStaticConfig,
    PT2EQuantizer,
    TorchAOQuantizer,
)
from hfexport.runtime.generation import generate
from hfexport.tiny import TINY_MODELS

TINY = TINY_MODELS["tiny-llama"]
VOCAB = 1024
NEW = 8


def _model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(**{**TINY.config, "vocab_size": VOCAB}, tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(config).eval()


def _prompt(seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


CALIBRATION = [_prompt(seed) for seed in (1, 2)]  # generate kwargs: each component calibrates on its own inputs
INT4 = {"mode": "int4_sym", "group_size": 16}


def _x86() -> PT2EQuantizer:
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )

    quantizer = X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())
    return PT2EQuantizer(quantizer, calibration_dataset=CALIBRATION)


def _xnnpack() -> PT2EQuantizer:
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )

    quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config())
    return PT2EQuantizer(quantizer, calibration_dataset=CALIBRATION)


# (quantizer id, export format, quantizer factory): each quantizer of the table on each backend it supports.
CASES: list[tuple[str, str, Callable[[], Any]]] = [
    ("pt2e-x86", "dynamo", _x86),
    ("pt2e-x86", "onnx", _x86),
    ("pt2e-x86", "openvino", _x86),
    ("pt2e-xnnpack", "executorch", _xnnpack),
    ("torchao-8da4w", "executorch", TorchAOQuantizer),
    ("torchao-8da4w", "dynamo", TorchAOQuantizer),
    ("nncf-fx-int4", "dynamo", lambda: NNCFTorchFXQuantizer(NNCFWeightCompressionConfig(**INT4))),
    ("nncf-fx-int4", "onnx", lambda: NNCFTorchFXQuantizer(NNCFWeightCompressionConfig(**INT4))),
    ("nncf-fx-int4", "executorch", lambda: NNCFTorchFXQuantizer(NNCFWeightCompressionConfig(**INT4))),
    ("nncf-fx-int4", "openvino", lambda: NNCFTorchFXQuantizer(NNCFWeightCompressionConfig(**INT4))),
    ("ort-static", "onnx", lambda: OnnxRuntimeQuantizer(OnnxRuntimeStaticConfig(), calibration_dataset=CALIBRATION)),
    ("ort-dynamic", "onnx", lambda: OnnxRuntimeQuantizer(OnnxRuntimeDynamicConfig())),
    ("nncf-onnx-int4", "onnx", lambda: NNCFOnnxQuantizer(NNCFWeightCompressionConfig(**INT4))),
    ("nncf-onnx-int8", "onnx", lambda: NNCFOnnxQuantizer(NNCFQuantizationConfig(), calibration_dataset=CALIBRATION)),
    ("nncf-openvino-int4", "openvino", lambda: NNCFOpenVINOQuantizer(NNCFWeightCompressionConfig(**INT4))),
    (
        "nncf-openvino-int8",
        "openvino",
        lambda: NNCFOpenVINOQuantizer(NNCFQuantizationConfig(), calibration_dataset=CALIBRATION),
    ),
]
# The bug this file was written for (NNCF int4 on ONNX failed on the tied head) runs in the default tier.
# Empty since 2026-12-02: the ONNX int4 case (43 s) moved to `slow` to keep CI within its budget; every case runs
# in the slow tier.
FAST: set[tuple[str, str]] = set()


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return _model()


def _export(model: torch.nn.Module, export_format: str, quantizer: Any = None) -> tuple[Any, Any]:
    options: dict[str, Any] = {"export_format": export_format, "dynamic": True}
    config = AutoExportConfig.from_dict(options)
    if quantizer is not None:
        import dataclasses

        config = dataclasses.replace(config, quantizer=quantizer)
    exporter = AutoHfExporter.from_config(config)
    return exporter.export_for_generation(model, _prompt(0), config), exporter


def _tokens(components: Any) -> torch.Tensor:
    prompt = _prompt(0)
    return generate(components, prompt["input_ids"], prompt["attention_mask"], max_new_tokens=NEW, min_new_tokens=NEW)


_FP32: dict[str, torch.Tensor] = {}


def _fp32_tokens(model: torch.nn.Module, export_format: str) -> torch.Tensor:
    if export_format not in _FP32:
        components, _ = _export(model, export_format)
        _FP32[export_format] = _tokens(components)
        del components
        gc.collect()
    return _FP32[export_format]


@pytest.mark.parametrize(
    ("name", "export_format", "make"),
    [
        pytest.param(*case, id=f"{case[0]}-{case[1]}", marks=() if case[:2] in FAST else pytest.mark.slow)
        for case in CASES
    ],
)
def test_generation_with_quantizer(model: torch.nn.Module, name: str, export_format: str, make: Any) -> None:
    components, exporter = _export(model, export_format, make())
    for component in ("prefill", "decode"):
        record = exporter.reports[component].quantization
        assert record is not None and record.quantized_ops > 0, (component, record)
    tokens = _tokens(components)
    del components
    gc.collect()
    prompt = _prompt(0)["input_ids"]
    assert tokens.shape == (2, 8 + NEW) and torch.equal(tokens[:, :8], prompt)
    assert ((tokens >= 0) & (tokens < VOCAB)).all()
    reference = _fp32_tokens(model, export_format)
    agreement = (tokens[:, 8:] == reference[:, 8:]).double().mean().item()
    print(f"{name} on {export_format}: greedy tokens agree with the fp32 export's at {agreement:.0%}")
