"""Views with one dynamic axis: that axis as -1, so that XNNPACK's partition takes the view."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_symbols

from hfexport.rewrites.examples import Built, Match, NoMatch
from hfexport.rewrites.kinds.fx import NodeRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.executorch._view_sizes import inferred_sizes

_VIEWS = (torch.ops.aten.view.default, torch.ops.aten.reshape.default, torch.ops.aten._unsafe_view.default)


def _dynamic_axes(value: Any) -> list[int]:
    return [axis for axis, size in enumerate(value.shape) if free_symbols(size)]


def _one_dynamic_axis_view(node: fx.Node) -> bool:
    """A view (or reshape) given a symbolic size, whose input and output each have one dynamic axis at most and
    whose output's other axes are static and non-zero: there `-1` on the dynamic axis names the same shape."""
    if node.op != "call_function" or node.target not in _VIEWS or len(node.args) < 2:
        return False
    shape = node.args[1]
    if not isinstance(shape, (list, tuple)) or all(isinstance(size, int) for size in shape):
        return False  # already plain ints (static, or one -1): XNNPACK takes it as it is
    value = node.meta.get("val")
    source = getattr(node.args[0], "meta", {}).get("val")
    if not isinstance(value, torch.Tensor) or not isinstance(source, torch.Tensor):
        return False
    sizes = inferred_sizes(value)
    return sizes is not None and -1 in sizes and len(_dynamic_axes(source)) <= 1


def _as_inferred(gm: fx.GraphModule, node: fx.Node) -> None:
    """`view(x, [1, s, -1, 64])` (or `[1, s, 9, 64]`) -> `view(x, [1, -1, 9, 64])`: the static sizes from the traced
    output, -1 on the one dynamic axis. The same view for every size the dynamic axis takes, since the other
    sizes are fixed and non-zero; the graph's `sym_size` calls it no longer uses go with the dead code."""
    node.args = (node.args[0], inferred_sizes(node.meta["val"]), *node.args[2:])


class _Heads(torch.nn.Module):
    """An attention projection's split into heads and back, as transformers writes it: `(*shape[:-1], -1, 8)`
    and `reshape(*shape[:2], -1)`, between a projection and elementwise work (one XNNPACK partition when the
    views join it). The projection's weight makes the feature axis static, as in a model."""

    def __init__(self, explicit: bool = False) -> None:
        super().__init__()
        self.explicit = explicit
        self.proj = torch.nn.Linear(24, 24)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scaled = self.proj(x)
        heads = scaled.view(x.shape[0], x.shape[1], 3, 8) if self.explicit else scaled.view(*x.shape[:-1], -1, 8)
        mixed = torch.sigmoid(heads) + heads
        return mixed.reshape(*x.shape[:2], -1) * 2.0


def _states(batch: int, length: int, seed: int = 0) -> dict[str, Any]:
    return {"x": torch.randn(batch, length, 24, generator=torch.Generator().manual_seed(seed))}


def _built(batch: int = 1, length: int = 6, explicit: bool = False) -> Built:
    torch.manual_seed(0)
    return _Heads(explicit).eval(), _states(batch, length)


one_dynamic_axis_view_inferred = NodeRule(
    RuleMeta(
        id="executorch/one-dynamic-axis-view-inferred",
        why="XNNPACK's partitioner refuses a view whose size arguments are symbolic ('Symbolic reshape is not "
        "supported'), though its reshape infers one -1 axis: with batch 1 and the sequence dynamic, every "
        "attention's split into heads and merge back (`view(*shape[:-1], -1, head_dim)`) runs outside the "
        "delegate and cuts the layer's partition in two. Observed on the SmolLM2-shaped Llama's multi-token "
        "decode graph at 4 layers (batch 1): 47 XNNPACK partitions without the rule, 39 with it, tokens equal"
        "; measured by tools/ab_rules.py (the executorch-static-decode form, 4 layers at "
        "SmolLM2-135M's width, batch 1, 128-token prompt, 64 new tokens, 2-core AVX2 EPYC): decode 1.00x (4 "
        "rounds: 169.5 against 169.5 tok/s) and 0.98x (8 rounds: 164.8 against 167.8): no decode gain on this "
        "CPU; what it changes is the partition count above",
        upstream="executorch==1.4.1 backends/xnnpack/partition/config/generic_node_configs.py ViewCopyConfig (symbolic "
        "sizes refused, one inferred size allowed)",
        backends=("executorch",),
        kind="optimization",
        examples=(
            Match(
                lambda: _built(),
                "view(*shape[:-1], -1, 8) and reshape(*shape[:2], -1) over batch 1 and a dynamic length, then "
                "another length",
                other_inputs=lambda: _states(1, 11, seed=1),
            ),
            Match(
                lambda: _built(explicit=True),
                "view(shape[0], shape[1], 3, 8) over batch 1 and a dynamic length, then a length of 1",
                other_inputs=lambda: _states(1, 1, seed=2),
            ),
            # Batch and length both dynamic (two symbolic sizes, XNNPACK's limit): left alone, in
            # tests/rewrites/test_executorch_rules.py (a NoMatch is exported static).
            NoMatch(lambda: _built(length=1), "a view of a static shape (ints only)"),
        ),
    ),
    predicate=_one_dynamic_axis_view,
    rewrite=_as_inferred,
)
