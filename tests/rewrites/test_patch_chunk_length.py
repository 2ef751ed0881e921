"""patch/bigbird-block-sparse-dense, patch/bigbird-pad-blocks, patch/deepseek-v4-window-buffer: the replacements
compute what the originals do (eager, at lengths on both sides of each shape test), and without the BigBird rules
the exported program refuses another length (the rules' examples, run in tests/rewrites/test_examples.py, show
that with them the programs match eager at both)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hfexport.rewrites.kinds.patch import NOT_APPLICABLE
from hfexport.rewrites.rules.patch import bigbird_block_sparse_dense as dense
from hfexport.rewrites.rules.patch import bigbird_pad_blocks as pad
from hfexport.rewrites.rules.patch import deepseek_v4_window_buffer as buffer


def _bind(module: torch.nn.Module, replacement: Any) -> None:
    original = type(module).forward.__get__(module)
    module.forward = lambda *args, **kwargs: replacement(original, module, *args, **kwargs)


@pytest.mark.parametrize("length", [40, 48, 68])
def test_dense_block_sparse_equals_the_original(length: int) -> None:
    model = dense._Sparse().eval()
    inputs = dense._sparse_inputs(length, seed=length)
    with torch.no_grad():
        expected = model(**inputs)
        _bind(model.attention, dense.forward)
        actual = model(**inputs)
    assert actual.shape == expected.shape == (2, length, 16)
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-6)
    # the masked queries of the padded row are zeroed, as the original's `* from_mask`
    assert actual[1, -6:].abs().max() == 0 and actual[1, 1].abs().max() == 0


def test_block_counts_follow_the_block_sparse_pattern() -> None:
    counts = dense.block_counts(6 * 2, block_size=2, num_random_blocks=3, device=torch.device("cpu"))
    blocks = counts[::2, ::2]  # one query and one key per block of 2
    assert torch.equal(blocks[0], torch.ones(6)) and torch.equal(blocks[5], torch.ones(6))  # global rows
    assert blocks[1].tolist() == [4, 1, 1, 0, 0, 1]  # block 0: sliding + 3 random copies
    assert blocks[3].tolist() == [4, 0, 1, 1, 1, 1]  # first, band 2..4, last (band reaches it)
    assert blocks[4].tolist() == [4, 0, 0, 1, 1, 1]


@pytest.mark.parametrize("length", [48, 50, 51])
def test_pad_blocks_equals_the_original(length: int) -> None:
    model = pad._model()
    inputs = pad._inputs(length, seed=length)
    with torch.no_grad():
        expected = model(**inputs)
        for module in model.modules():
            if type(module).__name__ == "BigBirdBlockSparseAttention":
                _bind(module, dense.forward)
        _bind(model, pad.forward)
        actual = model(**inputs)
    assert actual.last_hidden_state.shape == (2, length, 16)
    torch.testing.assert_close(actual.last_hidden_state, expected.last_hidden_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(actual.pooler_output, expected.pooler_output, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("length", [7, 22, 36, 37])
def test_short_calls_take_full_attention_as_a_fresh_model(length: int) -> None:
    # block 4, 2 random blocks: eager turns to full attention up to (5 + 4) * 4 = 36 tokens
    fresh = pad._Fresh().eval()
    inputs = pad._inputs(length, seed=length)
    with torch.no_grad():
        expected = fresh(**inputs)
        assert fresh.model.attention_type == "block_sparse"  # set back by the wrapper
        for module in fresh.model.modules():
            if type(module).__name__ == "BigBirdBlockSparseAttention":
                _bind(module, dense.forward)
        _bind(fresh.model, pad.forward)
        actual = fresh(**inputs)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_pad_blocks_declines_full_attention_models() -> None:
    assert pad.forward(lambda **kwargs: None, pad._model("original_full"), **pad._inputs(48, 0)) is NOT_APPLICABLE


def test_window_buffer_keeps_the_same_rows() -> None:
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4CSACache

    config = DeepseekV4Config(
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}, sliding_window=8
    )
    original, patched = DeepseekV4CSACache(config), DeepseekV4CSACache(config)
    generator = torch.Generator().manual_seed(0)
    for length in (10, 3, 8, 1):  # remainders 2, then 2 + 3 = 5 (one window), 1 + 8, 1 + 1
        kv, gate = torch.randn(2, length, 6, generator=generator), torch.randn(2, length, 6, generator=generator)
        expected = original.store_compression_weights("indexer", kv, gate)
        actual = buffer.store_compression_weights(None, patched, "indexer", kv, gate)
        for a, e in zip(actual[:2], expected[:2], strict=True):
            assert torch.equal(a, e)
        assert actual[2] == expected[2]
        assert torch.equal(patched.buffer_kv["indexer"], original.buffer_kv["indexer"])
        assert torch.equal(patched.buffer_gate["indexer"], original.buffer_gate["indexer"])
        original.entry_count["indexer"] += expected[0].shape[1] // 4
        patched.entry_count["indexer"] += actual[0].shape[1] // 4


@pytest.mark.slow
def test_bigbird_refuses_another_length_without_its_rules() -> None:
    from hfexport.testing.harness import export_program

    model, inputs = pad._model(), pad._inputs(48, seed=0)
    with pytest.raises(Exception, match=r"Guard failed|[Cc]onstraint|specializ"):
        program = export_program(model, inputs, dynamic=True)
        with torch.no_grad():
            program.module()(**pad._inputs(50, seed=1))
