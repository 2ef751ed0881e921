"""Static-cache generation of sliding-window models: one decode graph, before, at and past the window.

transformers hands a static-cache step its masks by layer type (`{"full_attention", "sliding_attention"}`) or, for
a model whose every layer slides, one mask with the window in it, and keeps a sliding layer as a ring buffer driven
by a Python int. The export takes one 4-D mask over the cache slots instead (the generation loop's) and rebuilds
generate's masks from it in the graph (`hfexport.frontends.calls.LayerTypeMasks`); the ring buffer becomes a
full-length static layer (rule `patch/static-sliding-window-full-length`). These tests generate on real
components against `model.generate` on a left-padded batch whose prompt is longer than the window.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GenerationConfig

from hfexport import OnnxConfig, OnnxExporter, OpenVINOConfig, OpenVINOExporter
from hfexport.frontends.calls import LayerTypeMasks
from hfexport.rewrites.example_models import sliding_mistral
from hfexport.runtime.generation import generate

WINDOW, SLOTS, NEW = 5, 24, 6
BACKENDS = {"onnx": (OnnxExporter, OnnxConfig), "openvino": (OpenVINOExporter, OpenVINOConfig)}


def _gemma2(window: int) -> torch.nn.Module:
    """A tiny two-layer Gemma2 (sliding, then full attention; eager attention with an additive float mask)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        sliding_window=window,
        max_position_embeddings=256,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=1,
    )
    return transformers.Gemma2ForCausalLM(config).eval()


def _prompt() -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of 9 tokens (past the window of 5), the second left-padded by 2."""
    ids = torch.randint(3, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    ids[1, :2] = 0
    return ids, mask


def _check(model: torch.nn.Module, backend: str) -> None:
    exporter_class, config_class = BACKENDS[backend]
    static = GenerationConfig(cache_implementation="static", max_cache_len=SLOTS)
    sample = {"input_ids": torch.randint(3, 64, (2, 3), generator=torch.Generator().manual_seed(0))}
    exporter = exporter_class()
    components = exporter.export_for_generation(
        model, sample, config_class(dynamic=True), generation_config=static, multi_token_decode=True
    )
    # The rule ran while generate was recorded: every layer's keys have all the slots (no ring buffer of 5).
    leaves = [leaf for leaf in components.spec.components["decode"].cache_leaves if len(leaf.shape) == 4]
    assert leaves and all(leaf.shape[2] == SLOTS for leaf in leaves), [leaf.shape for leaf in leaves]
    ids, mask = _prompt()
    config = GenerationConfig(
        cache_implementation="static",
        max_cache_len=SLOTS,
        max_new_tokens=NEW,
        min_new_tokens=NEW,
        do_sample=False,
        pad_token_id=0,
    )
    with torch.no_grad():
        expected = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    got = generate(components, ids, mask, max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=0)
    assert torch.equal(got, expected), (got, expected)


@pytest.mark.slow  # ~11 s a backend at load 3; the gemma2 test below runs the same path in the default tier
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_static_sliding_mistral_generates_past_the_window(backend: str) -> None:
    # Every layer slides: generate hands one bool 4-D mask with the window in it.
    _check(sliding_mistral(WINDOW), backend)


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.slow
def test_static_sliding_gemma2_generates_past_the_window(backend: str) -> None:
    # Hybrid: generate hands a dict of masks by layer type, additive float masks (eager attention).
    _check(_gemma2(WINDOW), backend)


def test_layer_type_masks_rebuild_sliding_rows_with_padding() -> None:
    # Slots 0-1 padding, 2-7 written; queries at slots 5-7: each sliding row keeps its last 3 slots that are valid.
    valid = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 0, 0]]).bool()
    rows = torch.arange(5, 8)
    plain = ((torch.arange(10)[None, :] <= rows[:, None])[None] & valid[:, None, :])[:, None]
    built = LayerTypeMasks((("full_attention", None), ("sliding_attention", 3)), torch.bool).build(plain)
    assert torch.equal(built["full_attention"], plain)
    assert built["sliding_attention"][0, 0].nonzero()[:, 1].tolist() == [3, 4, 5, 4, 5, 6, 5, 6, 7]
    additive = LayerTypeMasks(((None, 3),), torch.float32).build(plain)
    assert additive.dtype == torch.float32 and torch.equal(additive == 0, built["sliding_attention"])
