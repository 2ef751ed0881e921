"""What a cached grouped-query attention copies on OpenVINO's CPU plugin, with and without the copy rules.

`openvino/grouped-sdpa-without-repeat-kv` and `openvino/copy-back-without-broadcast` exist to take whole-cache
copies out of a decode step; their examples (tests/rewrites/test_examples.py) prove the numbers, and this proves
the copies are gone from the compiled graph of a stateful static-cache decode: the attention reads the cache as
the scatter wrote it (no repeat_kv broadcast, no key Multiply or Transpose), and the state is assigned the
scatter's result (no Broadcast of the cache onto its own shape). Tokens stay those of `model.generate`.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

pytest.importorskip("openvino")

import openvino as ov
from transformers import GenerationConfig

from hfexport import OpenVINOConfig, OpenVINOExporter, RuleSelection
from hfexport.runtime.generation import generate
from hfexport.tiny import TINY_MODELS

RULES = ("openvino/grouped-sdpa-without-repeat-kv", "openvino/copy-back-without-broadcast")
TINY = TINY_MODELS["tiny-llama"]  # GQA
NEW = 5


def _export(model: torch.nn.Module, rules: RuleSelection) -> tuple[Any, Any]:
    exporter = OpenVINOExporter()
    components = exporter.export_for_generation(
        model,
        TINY.sample_inputs(),
        OpenVINOConfig(dynamic=True, stateful=True, rules=rules),
        generation_config=GenerationConfig(cache_implementation="static", max_cache_len=32),
        multi_token_decode=True,
    )
    return components, exporter


def _cache_readers(model: Any) -> tuple[Counter[str], Counter[str]]:
    """The op types that feed the compiled attentions' key input, and the compiled state writes' input."""
    compiled = ov.Core().compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    keys, writes = Counter(), Counter()
    for op in compiled.get_runtime_model().get_ordered_ops():
        kind = op.get_rt_info()["layerType"].astype(str)
        port = 0 if kind == "MemoryOutput" else 1
        if op.get_input_size() <= port:
            continue
        source = op.input(port).get_source_output().get_node()
        producer = source.get_rt_info()["layerType"].astype(str)
        attention = kind in ("Subgraph", "ScaledDotProductAttention")
        if attention and "scaled_dot_product_attention" in op.get_friendly_name():
            keys[producer] += 1
        elif kind == "MemoryOutput":
            writes[producer] += 1
    return keys, writes


@pytest.mark.slow
def test_the_cache_is_no_longer_copied_in_a_decode_step() -> None:
    model = TINY.build()
    before, exporter_before = _export(model, RuleSelection(disable=RULES))
    after, exporter = _export(model, RuleSelection())
    layers = model.config.num_hidden_layers
    fired, fired_before = exporter.reports["decode"].fired, exporter_before.reports["decode"].fired
    assert all(rule in fired for rule in RULES) and not any(rule in fired_before for rule in RULES), fired
    keys, writes = _cache_readers(before["decode"])
    # Without the rules: the keys reach the attention through repeat_kv's broadcast and a transpose, and each
    # state is assigned a Broadcast of the scattered cache onto its own shape.
    assert "ScatterElementsUpdate" not in keys and sum(keys.values()) == layers, keys
    assert writes["Broadcast"] == 2 * layers, writes
    keys, writes = _cache_readers(after["decode"])
    assert keys == Counter({"ScatterElementsUpdate": layers}), keys
    assert writes == Counter({"ScatterElementsUpdate": 2 * layers}), writes
    inputs = TINY.sample_inputs()
    with torch.no_grad():
        expected = model.generate(**inputs, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False)
    got = generate(after, inputs["input_ids"], inputs["attention_mask"], max_new_tokens=NEW, min_new_tokens=NEW)
    assert torch.equal(got, expected)
