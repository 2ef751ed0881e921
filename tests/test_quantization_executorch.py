"""`PT2EQuantizer(XNNPACKQuantizer(...))` on ExecuTorch with the random tiny Llama, run in this process.

Two rules carry the quantized Llama through XNNPACK: `executorch/quant-slice-keeps-qparams` (rotate_half's slices,
which XNNPACK otherwise refuses to load) and `executorch/quant-identity-requantize` (LlamaRMSNorm's
`.to(input_dtype)`, a quantize of a dequantize with the same parameters, which XNNPACK in executorch 1.4.1 fuses
into a lookup table it frees twice: the method ran on freed memory, cosine about 0.8, and destroying it aborted
the process with "double free or corruption"). Each test loads the program, runs it, compares the logits with fp32
eager and destroys the method here, in the test process: before the rule, that killed the test run.
"""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("executorch")
pytest.importorskip("torchao")

from hfexport import ExecutorchConfig, ExecutorchExporter, PT2EQuantizer
from hfexport.tiny import TINY_MODELS

TINY = TINY_MODELS["tiny-llama"]
# Measured 0.995 to 0.998 (per-tensor symmetric int8 activations and weights, on an AVX2 CPU without VNNI);
# before executorch/quant-identity-requantize, 0.79 to 0.86 (the fused lookup tables read from freed memory).
MIN_COSINE = 0.99
# Measured 0.994 (prefill) and 0.990 (decode: one token on the sample's 8-token cache); a little more room than
# for the plain exports.
MIN_COSINE_GENERATION = 0.98


@pytest.fixture(scope="module")
def tiny() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    return TINY.build(), TINY.sample_inputs()


def _xnnpack(calibration: list[dict[str, torch.Tensor]]) -> PT2EQuantizer:
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )

    return PT2EQuantizer(XNNPACKQuantizer().set_global(get_symmetric_quantization_config()), calibration)


def _feed(shape: tuple[int, int], seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, TINY.config["vocab_size"], shape, generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _cosine(actual: Any, expected: torch.Tensor) -> float:
    actual = torch.as_tensor(np.asarray(actual)).flatten().double()
    assert torch.isfinite(actual).all()
    return torch.nn.functional.cosine_similarity(actual, expected.flatten().double(), dim=0).item()


def _hits(report: Any) -> dict[str, int]:
    return {rule.id: rule.hits for rule in report.rules if rule.hits}


@pytest.mark.slow
@pytest.mark.parametrize("dynamic", [pytest.param(False, id="static"), pytest.param(True, id="dynamic")])
def test_pt2e_xnnpack_tiny_llama_on_executorch(tiny: Any, tmp_path: Path, dynamic: bool) -> None:
    from hfexport.runtime.executorch import ExecutorchProgram

    model, inputs = tiny
    exporter = ExecutorchExporter()
    calibration = [TINY.sample_inputs(seed) for seed in (1, 2)]
    manager = exporter.export(model, inputs, ExecutorchConfig(dynamic=dynamic, quantizer=_xnnpack(calibration)))
    assert exporter.report.quantization.op_counts.get("quantized_decomposed.quantize_per_tensor", 0) > 0
    hits = _hits(exporter.report)
    # The five RMSNorms (two per layer and the final one) each cast back to the input dtype.
    assert hits.get("executorch/quant-identity-requantize", 0) >= 5, hits
    assert hits.get("executorch/quant-slice-keeps-qparams", 0) > 0, hits
    targets = {str(n.target) for n in manager.exported_program("forward").graph.nodes if n.op == "call_function"}
    assert "executorch_call_delegate" in targets
    path = tmp_path / "model.pte"
    manager.save(str(path))

    feeds = [inputs] + ([_feed((1, 5), 5), _feed((3, 11), 11)] if dynamic else [])
    for _ in range(2):  # load, run and destroy twice: a double free aborts at the first destruction
        runtime = ExecutorchProgram(str(path))
        for feed in feeds:
            with torch.no_grad():
                expected = model(**feed).logits
            cosine = _cosine(runtime.run(feed)[0], expected)
            print(f"{tuple(feed['input_ids'].shape)}: logits cosine {cosine:.4f}")
            assert cosine >= MIN_COSINE
        del runtime
        gc.collect()


@pytest.mark.slow
def test_pt2e_xnnpack_tiny_llama_generation_on_executorch(tiny: Any) -> None:
    import copy

    from hfexport.runtime.executorch import ExecutorchProgram
    from hfexport.runtime.generation import generate

    model, inputs = tiny
    exporter = ExecutorchExporter()
    prompts = [TINY.sample_inputs(seed) for seed in (1, 2)]  # generate kwargs: each component calibrates on its own
    components = exporter.export_for_generation(
        model, inputs, ExecutorchConfig(dynamic=True, quantizer=_xnnpack(prompts))
    )
    for name in ("prefill", "decode"):
        assert exporter.reports[name].quantization.quantized_ops > 0, name
        assert _hits(exporter.reports[name]).get("executorch/quant-identity-requantize", 0) >= 5, name
        sample = components.samples[name]
        runtime = ExecutorchProgram(components[name])
        logits = runtime.run(copy.deepcopy(sample))[0]
        with torch.no_grad():
            expected = model(**copy.deepcopy(sample)).logits
        cosine = _cosine(logits, expected)
        print(f"{name}: logits cosine {cosine:.4f}")
        assert cosine >= MIN_COSINE_GENERATION, name
        del runtime
        gc.collect()

    tokens = generate(components, inputs["input_ids"], inputs["attention_mask"], max_new_tokens=8)
    assert tokens.shape == (2, 16) and torch.equal(tokens[:, :8], inputs["input_ids"])
    assert ((tokens >= 0) & (tokens < TINY.config["vocab_size"])).all()
    del components
    gc.collect()
