"""DeepSeek-V4's compressor counts (`entry_count[name]`) as sizes of the compressed entries, not numbers.

Dynamo generation of the corpus deepseek_v4 (2026-12-03) failed at a decode step with "Trying to flatten user
inputs with exported input tree spec": the cache layers' `entry_count` dicts were plain ints in the pytree context
(2 windows traced, 3 at the step), so every step that emitted a compressed entry was another pytree. The count is
`compressed_kv[name].shape[1]` by construction (`update_compressor_states` appends and adds the same rows), and
`hfexport.core.cache_pytree` now keeps it as that size (`_DERIVED_KEY_SIZES`).
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from hfexport.core.cache_context import dump_context, load_context
from hfexport.core.cache_pytree import register_cache_pytrees
from hfexport.rewrites.rules.patch._deepseek_v4 import deepseek_v4_example


def _cache(tokens: int) -> object:
    model, _ = deepseek_v4_example(tokens)
    ids = torch.randint(3, 64, (2, tokens), generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        return model(input_ids=ids, use_cache=True).past_key_values


def test_entry_count_is_the_compressed_length_in_the_context() -> None:
    short, long = _cache(8), _cache(13)
    register_cache_pytrees()
    counts = [dict(layer.entry_count) for layer in long.layers if hasattr(layer, "entry_count")]
    assert counts == [{"compressor": 3, "indexer": 3}]  # 13 tokens, windows of 4 (the CSA layer)
    assert [dict(layer.entry_count) for layer in short.layers if hasattr(layer, "entry_count")] == [
        {"compressor": 2, "indexer": 2}
    ]
    _, short_spec = pytree.tree_flatten(short)
    long_leaves, long_spec = pytree.tree_flatten(long)
    assert short_spec == long_spec  # one decode program takes the cache at every step

    rebuilt = pytree.tree_unflatten(long_leaves, long_spec)
    assert [dict(layer.entry_count) for layer in rebuilt.layers if hasattr(layer, "entry_count")] == counts
    layer = next(layer for layer in rebuilt.layers if hasattr(layer, "entry_count"))
    original = next(layer for layer in long.layers if hasattr(layer, "entry_count"))
    assert all(torch.equal(layer.compressed_kv[k], original.compressed_kv[k]) for k in original.compressed_kv)

    context = long_spec.context  # a saved program's context: checked and read back (the `K` node)
    assert load_context(dump_context(context)) == context

    placeholder = pytree.tree_unflatten([0] * long_spec.num_leaves, long_spec)  # executorch's emitter's way
    assert [dict(layer.entry_count) for layer in placeholder.layers if hasattr(layer, "entry_count")] == [
        {"compressor": None, "indexer": None}
    ]


def test_a_count_that_is_not_the_size_stays_a_number() -> None:
    cache = _cache(8)
    register_cache_pytrees()
    layer = next(layer for layer in cache.layers if hasattr(layer, "entry_count"))
    layer.entry_count["indexer"] = 5  # not compressed_kv["indexer"].shape[1] (2): kept as the number
    leaves, spec = pytree.tree_flatten(cache)
    rebuilt = pytree.tree_unflatten(leaves, spec)
    assert next(x for x in rebuilt.layers if hasattr(x, "entry_count")).entry_count == {"compressor": 2, "indexer": 5}
