"""Trailing unsqueezes of tensors with several dynamic axes: keep them out of XNNPACK's static reshape."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_symbols

from hfexport.rewrites.examples import Built, Match, NoMatch
from hfexport.rewrites.kinds.fx import NodeRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.executorch._view_sizes import view_sizes

_UNSQUEEZE = torch.ops.aten.unsqueeze.default
_STACK = torch.ops.aten.stack.default
_VIEW = torch.ops.aten.view.default
_CAT = torch.ops.aten.cat.default
_SYM_SIZE = torch.ops.aten.sym_size.int


def _dynamic_axes(value: Any) -> int:
    return sum(1 for size in value.shape if free_symbols(size)) if isinstance(value, torch.Tensor) else 0


def _trailing_unsqueeze_of_dynamic(node: fx.Node) -> bool:
    """An unsqueeze (or a stack, which to_edge decomposes into unsqueezes and a cat) on the last axis of its
    result, where that result has more than one dynamic axis: the case XNNPACK's partitioner takes and its
    static reshape then refuses."""
    if node.op != "call_function" or node.target not in (_UNSQUEEZE, _STACK):
        return False
    value = node.meta.get("val")
    if not isinstance(value, torch.Tensor) or _dynamic_axes(value) < 2:
        return False
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    return isinstance(dim, int) and dim in (-1, value.ndim - 1)


def _with_trailing_one(gm: fx.GraphModule, tensor: fx.Node) -> fx.Node:
    view = gm.graph.call_function(_VIEW, (tensor, [*view_sizes(gm, tensor), 1]))
    view.meta = {k: v for k, v in tensor.meta.items() if k != "val"}
    view.meta["val"] = tensor.meta["val"].unsqueeze(-1)
    return view


def _unsqueeze_as_view(gm: fx.GraphModule, node: fx.Node) -> None:
    """`unsqueeze(x, -1)` -> `view(x, [*x.shape, 1])`; `stack(xs, -1)` -> `cat([view(x, [*x.shape, 1]) ...], -1)`.

    A view with symbolic sizes stays out of the XNNPACK partition (its partitioner refuses symbolic
    reshapes) and runs as the portable `view_copy`; adding a size-1 axis is a valid view of any layout.
    """
    with gm.graph.inserting_before(node):
        if node.target is _UNSQUEEZE:
            replacement = _with_trailing_one(gm, node.args[0])
        else:
            parts = [_with_trailing_one(gm, t) for t in node.args[0]]
            replacement = gm.graph.call_function(_CAT, (parts, -1))
    replacement.meta = dict(node.meta)
    node.replace_all_uses_with(replacement)
    gm.graph.erase_node(node)


class _InterleavedRotary(torch.nn.Module):
    """Cohere's `rotate_half`: the even and odd features swapped with a sign, interleaved by `stack(..., -1)`."""

    def __init__(self, dim: int = -1, unsqueeze: bool = False) -> None:
        super().__init__()
        self.dim = dim
        self.unsqueeze = unsqueeze

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., ::2], x[..., 1::2]
        if self.unsqueeze:
            rotated = torch.cat([(-x2).unsqueeze(-1), x1.unsqueeze(-1)], dim=-1).flatten(-2)
        elif self.dim == -1:
            rotated = torch.stack([-x2, x1], dim=-1).flatten(-2)
        else:  # the same values, stacked on the axis before the last
            rotated = torch.stack([-x2, x1], dim=-2).transpose(-1, -2).flatten(-2)
        return x * 0.5 + rotated * 2.0


def _states(batch: int, length: int, seed: int = 0) -> dict[str, Any]:
    return {"x": torch.randn(batch, 2, length, 8, generator=torch.Generator().manual_seed(seed))}


def _built(dim: int = -1, unsqueeze: bool = False) -> Built:
    return _InterleavedRotary(dim, unsqueeze), _states(2, 6)


dynamic_trailing_unsqueeze_as_view = NodeRule(
    RuleMeta(
        id="executorch/dynamic-trailing-unsqueeze-as-view",
        why="XNNPACK's partitioner takes a trailing unsqueeze (also the unsqueezes `stack(..., dim=-1)` "
        "decomposes into) without checking its dynamic axes, and its static reshape then fails the lowering "
        "with 'XNNPACK reshape only supports 1 dynamic dimension' when batch and sequence are both dynamic "
        "(Cohere's interleaved rotary embedding); the same values as a view with symbolic sizes run as the "
        "portable view_copy",
        upstream="https://github.com/pytorch/executorch/issues/11449 (squeeze/unsqueeze through XNNPACK's "
        "static_reshape, limited to one dynamic dimension; fuse_dims/expand_dims would lift it)",
        backends=("executorch",),
        models=("cohere", "cohere2_moe", "ernie4_5_moe"),
        examples=(
            Match(
                lambda: _built(),
                "stack([-x2, x1], -1) over dynamic batch and length, then another batch and length",
                other_inputs=lambda: _states(3, 11, seed=1),
            ),
            Match(
                lambda: _built(unsqueeze=True),
                "x.unsqueeze(-1) over dynamic batch and length, then another batch and length",
                other_inputs=lambda: _states(1, 9, seed=2),
            ),
            NoMatch(lambda: _built(dim=-2), "a stack on the axis before the last (XNNPACK does not take it)"),
            NoMatch(lambda: _built(), "a trailing stack of a static shape (the export is static)"),
        ),
    ),
    predicate=_trailing_unsqueeze_of_dynamic,
    rewrite=_unsqueeze_as_view,
)
