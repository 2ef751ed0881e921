"""OpenVINO stateful decode (`OpenVINOConfig(stateful=True)`): the cache lives in the infer request.

The tiny Llama is exported for generation stateful and stateless; `hfexport.runtime.generate` must give the
same greedy tokens as the stateless export and as `model.generate`, with a dynamic cache and with a static
cache (multi-token decode), twice in a row (the state is reset per generation, at another batch size the
second time), and from the saved IR too.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("openvino")

import openvino as ov
from transformers import GenerationConfig

from hfexport import OpenVINOConfig, OpenVINOExporter
from hfexport.artifacts import load, save
from hfexport.runtime.generation import generate
from hfexport.tiny import TINY_MODELS

TINY = TINY_MODELS["tiny-llama"]
NEW = 6


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return TINY.build()


def _eager(model: torch.nn.Module, inputs: dict[str, torch.Tensor], generation_config: Any = None) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            **inputs,
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            generation_config=generation_config,
        )


def _export(model: torch.nn.Module, stateful: bool, generation_config: Any = None) -> tuple[Any, Any]:
    exporter = OpenVINOExporter()
    components = exporter.export_for_generation(
        model,
        TINY.sample_inputs(),
        OpenVINOConfig(dynamic=True, stateful=stateful),
        generation_config=generation_config,
        multi_token_decode=generation_config is not None,
    )
    return components, exporter


def _generate(components: Any, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    return generate(components, inputs["input_ids"], inputs["attention_mask"], max_new_tokens=NEW, min_new_tokens=NEW)


@pytest.mark.slow  # 50 s on the 2-core CI machine: moved out of the default tier to keep CI within its budget
def test_stateful_decode_with_a_dynamic_cache(model: torch.nn.Module, tmp_path: Path) -> None:
    stateless, _ = _export(model, stateful=False)
    stateful, exporter = _export(model, stateful=True)
    decode = stateful["decode"]
    # The cache is no input or output of the stateful decode: four variables (keys, values of two layers).
    assert len(decode.get_variables()) == 4 and len(decode.get_sinks()) == 4
    assert [p.get_any_name() for p in decode.inputs] == ["input_ids", "attention_mask", "position_ids"]
    assert [p.get_any_name() for p in decode.outputs] == ["logits"]
    assert "4 cache variable(s)" in exporter.reports["decode"].used["stateful"]
    assert exporter.reports["prefill"].notes  # the prefill takes no cache: it stays stateless, with a note
    # The growing cache has the form the CPU plugin fuses: one stateful attention per layer appends to the cache
    # in place (no Concatenation of the cache, no decomposed MatMul/Softmax).
    compiled = ov.Core().compile_model(decode, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    kinds = Counter(op.get_rt_info()["layerType"].astype(str) for op in compiled.get_runtime_model().get_ordered_ops())
    assert kinds["ScaledDotProductAttention"] == 2 and kinds["Softmax"] == 0

    for seed, batch in ((0, 2), (1, 3)):  # a second generation starts from a reset state, at another batch size
        inputs = TINY.sample_inputs(seed, batch=batch)
        expected = _eager(model, inputs)
        assert torch.equal(_generate(stateless, inputs), expected)
        assert torch.equal(_generate(stateful, inputs), expected)

    save(stateful, tmp_path / "gen")
    loaded = load(tmp_path / "gen")
    inputs = TINY.sample_inputs(2)
    assert torch.equal(_generate(loaded, inputs), _eager(model, inputs))


@pytest.mark.slow
def test_stateful_decode_with_a_static_cache(model: torch.nn.Module) -> None:
    static = GenerationConfig(cache_implementation="static", max_cache_len=24)
    stateless, _ = _export(model, stateful=False, generation_config=static)
    stateful, _ = _export(model, stateful=True, generation_config=static)
    # Prefill and decode both take the static cache: both keep its keys and values as variables; the int64
    # lengths stay inputs and outputs (the CPU plugin keeps no i64 state).
    for name in ("prefill", "decode"):
        assert len(stateful[name].get_variables()) == 4
        assert [p.get_any_name() for p in stateful[name].outputs if "cumulative_length" in p.get_any_name()]
    for seed in (0, 1):
        inputs = TINY.sample_inputs(seed)
        expected = _eager(model, inputs, static)
        assert torch.equal(_generate(stateless, inputs), expected)
        assert torch.equal(_generate(stateful, inputs), expected)
