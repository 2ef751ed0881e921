"""A sliding-window cache's token counter (the `[0, count]` leaf of `hfexport.core.cache_pytree`) under a consumer that
unflattens the program's output spec with placeholder leaves.

executorch's emitter (`_TopLevelEmitter.__init__`, `create_container_str`) rebuilds the output containers from
`[0] * spec.num_leaves` to describe them; the counter's decoding read `leaf.shape[-1]` and `to_executorch` failed
with "'int' object has no attribute 'shape'" for every sliding-window model that returns its cache (mistral and
gemma3_text in the ExecuTorch sweep of 2026-12-02).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.utils._pytree as pytree

from hfexport.core.cache_pytree import register_cache_pytrees
from hfexport.rewrites.example_models import sliding_mistral


def _filled_cache() -> object:
    model = sliding_mistral(window=4)
    with torch.no_grad():
        out = model(input_ids=torch.randint(0, 64, (2, 6)), use_cache=True)
    return out.past_key_values


def test_placeholder_leaves_unflatten_without_a_counter() -> None:
    register_cache_pytrees()
    cache = _filled_cache()
    leaves, spec = pytree.tree_flatten(cache)
    counters = [leaf for leaf in leaves if leaf.ndim == 2 and leaf.shape[0] == 0]
    assert [leaf.shape[-1] for leaf in counters] == [6, 6]  # one per sliding layer: every token seen

    placeholder = pytree.tree_unflatten([0] * spec.num_leaves, spec)  # as executorch's emitter does
    assert [layer.cumulative_length for layer in placeholder.layers] == [None, None]

    rebuilt = pytree.tree_unflatten(leaves, spec)  # real leaves still carry the counter
    assert [layer.cumulative_length for layer in rebuilt.layers] == [6, 6]
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(rebuilt.layers, cache.layers, strict=True))


@pytest.mark.slow  # an ExecuTorch export: about 40 s of CPU
def test_executorch_program_keeps_the_sequence_axis_of_a_model_returning_its_counter(tmp_path: Path) -> None:
    # The counter leaf is made again each time the outputs are flattened, also in to_edge's retrace; made with
    # `empty`, executorch's dim-order pass (`_empty_dim_order(int[] size)`) turned the count into an int and guarded
    # the sequence axis to the sample's: mistral's program took only the sample's 8 tokens (sweep of 2026-12-02).
    pytest.importorskip("executorch")
    from hfexport import ExecutorchConfig, ExecutorchExporter
    from hfexport.runtime.executorch import ExecutorchProgram

    model = sliding_mistral(window=4)
    sample = {"input_ids": torch.randint(0, 64, (2, 3), generator=torch.Generator().manual_seed(0))}
    manager = ExecutorchExporter().export(model, sample, config=ExecutorchConfig(dynamic=True))
    manager.save(str(tmp_path / "model.pte"))
    program = ExecutorchProgram(tmp_path / "model.pte", input_names=["input_ids"])
    assert program.slots[0].max_sizes[1] == 256  # max_position_embeddings, not the sample's 3
    for batch, length in ((2, 3), (2, 11), (1, 5)):  # the sample, then longer than it and past the window
        ids = torch.randint(0, 64, (batch, length), generator=torch.Generator().manual_seed(length))
        with torch.no_grad():
            expected = model(input_ids=ids).logits
        logits = program.run({"input_ids": ids})[0]
        assert logits.shape == expected.shape
        assert (logits - expected).abs().max().item() < 1e-4, (batch, length)
