"""A cache write-back that OpenVINO converts to a Broadcast of the whole cache onto its own shape."""

from __future__ import annotations

from typing import Any

import torch

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.openvino import OpenVINOModelRule
from hfexport.rewrites.rule import RuleMeta

# Ops whose output has the shape of their first input, whatever the others are.
_SAME_SHAPE_AS_DATA = ("ScatterElementsUpdate", "ScatterUpdate", "ScatterNDUpdate")


def _source(op: Any, port: int) -> Any:
    return op.input(port).get_source_output()


def _onto_own_shape(op: Any) -> bool:
    """`Broadcast(x, ShapeOf(y))` where `x` has `y`'s shape by construction: `x` is `y`, or a scatter into `y`."""
    if op.get_type_name() != "Broadcast" or op.get_input_size() != 2:
        return False
    if op.get_attributes().get("mode") not in ("numpy", "bidirectional"):
        return False
    shape = _source(op, 1).get_node()
    if shape.get_type_name() != "ShapeOf":
        return False
    target = _source(shape, 0)
    data = _source(op, 0)
    if data == target:
        return True
    node = data.get_node()
    return node.get_type_name() in _SAME_SHAPE_AS_DATA and _source(node, 0) == target


def drop_broadcasts_onto_own_shape(model: Any) -> int:
    """Replace each `Broadcast(x, ShapeOf(y))` with `x` where `x` has `y`'s shape by construction; return how many."""
    found = [op for op in model.get_ordered_ops() if _onto_own_shape(op)]
    for op in found:
        # The model's inputs and outputs are named after the model rules (lowerings/openvino.py), so no tensor
        # name is carried over.
        op.output(0).replace(_source(op, 0))
    if found:
        model.validate_nodes_and_infer_types()
    return len(found)


class _CacheWrite(torch.nn.Module):
    """A static cache's update: write the new rows into the cache input in place, read the whole cache, and
    return the cache (as a decoder returns its `past_key_values`)."""

    def forward(self, cache: torch.Tensor, rows: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cache.index_copy_(2, position, rows)
        return cache.sum(-1) * 2, cache


class _Broadcast(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x.expand_as(y) + y


def _cache_inputs(batch: int, slots: int, new: int, start: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(slots)
    return {
        "cache": torch.randn(batch, 2, slots, 4, generator=generator),
        "rows": torch.randn(batch, 2, new, 4, generator=generator),
        "position": torch.arange(start, start + new),
    }


copy_back_without_broadcast = OpenVINOModelRule(
    RuleMeta(
        id="openvino/copy-back-without-broadcast",
        why="a static cache's write into its input (index_copy_) comes back from torch.export as a mutated input, "
        "which openvino.convert_model writes back with aten.copy_ translated to Broadcast(new cache, ShapeOf(old "
        "cache)): a copy of the whole cache onto its own shape, run by the CPU plugin's reference Broadcast kernel, "
        "for the keys and the values of every layer and decode step (1.6 ms of a 30-layer SmolLM2-135M stateful "
        "int4 step). The scatter's output already has the cache's shape (Scatter*Update keeps its data input's "
        "shape), so it is assigned (or returned) as it is, exactly",
        upstream="openvino==2026.4 PyTorch frontend: aten.copy_ is translated to Broadcast(src, ShapeOf(dst)), and "
        "a Broadcast of a dynamic shape is not removed as a no-op",
        backends=("openvino",),
        kind="optimization",
        models=("llama", "mistral", "qwen2", "qwen3", "gemma", "smollm3", "olmo2", "granite"),
        examples=(
            Match(
                lambda: (_CacheWrite(), _cache_inputs(2, 9, 3, 4)),
                "rows written into a cache input in place; then another batch, cache and row count",
                other_inputs=lambda: _cache_inputs(1, 16, 1, 11),
            ),
            NoMatch(
                lambda: (_Broadcast(), {"x": torch.randn(1, 3), "y": torch.randn(4, 3)}),
                "a Broadcast that widens a tensor to another's shape",
            ),
        ),
    ),
    transform=drop_broadcasts_onto_own_shape,
)
