"""NNCF int4 on ONNX keeps the fp32 export's attention-side fusions (issue #19, goal 2).

`NNCFOnnxQuantizer` used to export weight compression at opset 20 (where NNCF writes `MatMulNBits`), which cut
off the opset-23 fusions: the int4 decode graph had rotary unfused (Slice / Neg / Concat), repeat_kv's `Expand`
of the key and value cache and the decomposed attention. At the newest opset those fusions apply and
`onnx/blocked-dequantize-matmul-nbits` turns NNCF's blocked `DequantizeLinear` into the same `MatMulNBits`.
The numbers are compared with the opset-20 export of the same int4 weights (the graph before the change)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("nncf")
pytest.importorskip("onnxruntime")

NEW_TOKENS = 8


def _llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # SmolLM2-135M's layout at a tiny size: grouped-query attention (4 query / 2 key-value heads), tied head.
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        rope_theta=100000.0,
    )
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


def _prompt() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(1, 256, (2, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # left-padded second row
    return ids, mask


def _export(model: Any, opset: int | None) -> tuple[Any, Any]:
    import nncf
    from transformers import GenerationConfig

    from hfexport import AutoHfExporter, NNCFOnnxQuantizer, NNCFWeightCompressionConfig, OnnxConfig

    # The benchmark's recipe (hfexport.bench._onnx_int4): int4 groups of 32, the head too, the embedding float.
    recipe = NNCFWeightCompressionConfig(
        mode="int4_sym", group_size=32, all_layers=True, ignored_scope=nncf.IgnoredScope(types=["Gather"])
    )
    config = OnnxConfig(dynamic=True, quantizer=NNCFOnnxQuantizer(recipe), opset_version=opset)
    ids, _ = _prompt()
    sample = {"input_ids": ids[:, :4], "attention_mask": torch.ones_like(ids[:, :4])}
    exporter = AutoHfExporter.from_config(config)
    static = GenerationConfig(cache_implementation="static", max_cache_len=ids.shape[1] + NEW_TOKENS)
    # The static cache's multi-token decode graph takes the prompt too: `generate` runs it alone.
    components = exporter.export_for_generation(
        model, sample, config, generation_config=static, multi_token_decode=True, runtime_components=False
    )
    return components, exporter.reports["decode"]


def _ops(program: Any) -> Counter:
    return Counter(f"{node.domain or 'ai.onnx'}:{node.op_type}" for node in program.model.graph.all_nodes())


def _repeat_kv_expands(program: Any) -> int:
    """`Expand`s of an `Unsqueeze`d rank-4 cache into one more axis: repeat_kv's copy of the key/value heads."""
    count = 0
    for node in program.model.graph.all_nodes():
        source = node.inputs[0].producer() if node.op_type == "Expand" else None
        if source is not None and source.op_type == "Unsqueeze" and node.outputs[0].shape is not None:
            count += node.outputs[0].shape.rank() == 5
    return count


@pytest.fixture(scope="module")
def model() -> Any:
    return _llama()


@pytest.fixture(scope="module")
def newest(model: Any) -> tuple[Any, Any]:
    return _export(model, None)


@pytest.fixture(scope="module")
def opset20(model: Any) -> tuple[Any, Any]:
    return _export(model, 20)


def test_int4_decode_graph_has_the_fp32_fusions(newest: tuple[Any, Any]) -> None:
    components, report = newest
    decode = components["decode"]
    ops = _ops(decode)
    hits = report.hits["onnx"]
    for rule in ("rotary-embedding-fusion", "attention-drop-repeat-kv", "attention-as-matmul"):
        assert hits.get(f"onnx/{rule}") == 2 * (2 if rule == "rotary-embedding-fusion" else 1), (rule, hits)
    # q, k, v, o, gate, up, down per layer and the tied head: every weight MatMul is NNCF's MatMulNBits.
    assert hits.get("onnx/blocked-dequantize-matmul-nbits") == 15, hits
    assert ops["com.microsoft:MatMulNBits"] == 15 and ops["ai.onnx:DequantizeLinear"] == 0, ops
    assert ops["ai.onnx:RotaryEmbedding"] == 4 and ops["ai.onnx:Neg"] == 0, ops
    assert _repeat_kv_expands(decode) == 0


def test_int4_numbers_and_tokens_equal_the_opset20_export(newest: tuple[Any, Any], opset20: tuple[Any, Any]) -> None:
    from hfexport.runtime import generate
    from hfexport.runtime.generation import prompt_logits

    (new, _), (old, _) = newest, opset20
    # The graph before the change: no fusion, rotary written out, repeat_kv's Expand of the cache in each layer.
    assert _ops(old["decode"])["ai.onnx:RotaryEmbedding"] == 0 and _repeat_kv_expands(old["decode"]) == 4
    assert _ops(old["decode"])["com.microsoft:MatMulNBits"] == 15
    ids, mask = _prompt()
    logits = prompt_logits(new, ids, mask)
    reference = prompt_logits(old, ids, mask)
    real = mask.bool()  # padded positions are not read by generation
    assert logits.shape == reference.shape == (2, 7, 256)
    torch.testing.assert_close(logits[real], reference[real], atol=1e-5, rtol=1e-5)
    # Greedy decoding of a left-padded batch: the same tokens.
    tokens = generate(new, ids, mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    assert tokens.shape == (2, 7 + NEW_TOKENS)
    assert torch.equal(tokens, generate(old, ids, mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS))


def _dequantized(node: Any) -> tuple[np.ndarray, np.ndarray]:
    """(weight [N, K], the size of its int4 step per element) of a symmetric 4-bit `MatMulNBits`, as the op
    computes them (NNCF's symmetric scales carry the sign of the group's largest magnitude)."""
    attributes = {name: attribute.value for name, attribute in node.attributes.items()}
    k, n, block = attributes["K"], attributes["N"], attributes["block_size"]
    assert attributes["bits"] == 4 and (len(node.inputs) < 4 or node.inputs[3] is None), attributes
    packed = node.inputs[1].const_value.numpy()
    values = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(n, -1, block).astype(np.int16)
    scales = node.inputs[2].const_value.numpy().reshape(n, -1, 1)
    weight = ((values - 8) * scales).reshape(n, -1)[:, :k]
    return weight, np.abs(np.broadcast_to(scales, values.shape)).reshape(n, -1)[:, :k]


def test_int4_export_adds_no_error_beyond_its_weights(model: Any, newest: tuple[Any, Any]) -> None:
    """The int4 ONNX export computes what eager computes with NNCF's int4 weights, to float rounding: on the
    SmolLM2-shaped benchmark (random weights) it diverged from eager at the first greedy token where the OpenVINO
    export of the same recipe agreed on most tokens, and the difference was the recipe's rounding, not the graph
    (docs/quantization.md). Each `MatMulNBits` holds one of the model's weights, in its layout, rounded to the
    nearest int4 step of its group's scale; eager with those weights (the tied head untied: its copy is int4,
    the embedding stays float) gives the export's logits."""
    import copy

    from hfexport.runtime.generation import prompt_logits

    components, _ = newest
    int4 = copy.deepcopy(model)
    int4.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    originals = {name: p.detach().numpy() for name, p in int4.named_parameters() if p.dim() == 2}
    originals.pop("model.embed_tokens.weight")
    replaced = []
    for node in components["decode"].model.graph.all_nodes():
        if node.op_type != "MatMulNBits":
            continue
        weight, scale = _dequantized(node)
        # Round to nearest: within half a step of the original, a whole step where the group's largest value
        # (+8 steps) is clipped to +7.
        owners = [
            name
            for name, original in originals.items()
            if original.shape == weight.shape and np.all(np.abs(original - weight) <= scale * (1 + 1e-5))
        ]
        assert len(owners) == 1, (node.name, owners)
        replaced.append(owners[0])
        with torch.no_grad():
            int4.get_parameter(owners[0]).copy_(torch.from_numpy(weight))
    assert sorted(replaced) == sorted(originals), "every linear weight (the head too) is int4"
    ids, mask = _prompt()
    with torch.no_grad():
        expected = int4(input_ids=ids, attention_mask=mask).logits
    real = mask.bool()
    torch.testing.assert_close(prompt_logits(components, ids, mask)[real], expected[real], atol=1e-4, rtol=1e-4)
