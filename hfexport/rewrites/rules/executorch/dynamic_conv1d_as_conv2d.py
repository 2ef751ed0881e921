"""1-D convolutions over a dynamic batch and length: as 2-D ones, without XNNPACK's own unsqueeze."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_symbols

from hfexport.rewrites.examples import Built, Match, NoMatch
from hfexport.rewrites.kinds.fx import NodeRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.executorch._view_sizes import view_sizes

_CONV1D = torch.ops.aten.conv1d.default
_CONVOLUTION = torch.ops.aten.convolution.default
_VIEW = torch.ops.aten.view.default
_UNSQUEEZE = torch.ops.aten.unsqueeze.default


def _one(value: Any) -> int | None:
    """The single int of a 1-D conv parameter (`[2]`, `(2,)` or `2`), else None."""
    if isinstance(value, int):
        return value
    if isinstance(value, (list, tuple)) and len(value) == 1 and isinstance(value[0], int):
        return value[0]
    return None


def _conv_args(node: fx.Node) -> tuple[Any, ...] | None:
    """(input, weight, bias, stride, padding, dilation, groups) of a plain 1-D convolution, else None."""
    if node.target is _CONV1D:
        names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
        defaults = (None, None, None, 1, 0, 1, 1)
        args = [
            node.args[i] if i < len(node.args) else node.kwargs.get(n, d)
            for i, (n, d) in enumerate(zip(names, defaults, strict=True))
        ]
    elif node.target is _CONVOLUTION:
        x, w, b, stride, padding, dilation, transposed, _, groups = node.args
        if transposed:
            return None
        args = [x, w, b, stride, padding, dilation, groups]
    else:
        return None
    x, w, b, stride, padding, dilation, groups = args
    numbers = [_one(stride), _one(padding), _one(dilation)]
    if any(n is None for n in numbers) or not isinstance(groups, int):
        return None
    return (x, w, b, *numbers, groups)


def _dynamic_conv1d(node: fx.Node) -> bool:
    """A 1-D convolution whose [N, C, L] input has more than one dynamic axis: XNNPACK's partitioner takes it
    and unsqueezes it to 2-D itself, with a reshape that its static_reshape cannot do."""
    if node.op != "call_function" or node.target not in (_CONV1D, _CONVOLUTION):
        return False
    args = _conv_args(node)
    if args is None or not isinstance(args[0], fx.Node):
        return False
    value = args[0].meta.get("val")
    if not isinstance(value, torch.Tensor) or value.ndim != 3:
        return False
    return sum(1 for size in value.shape if free_symbols(size)) >= 2


def _as_conv2d(gm: fx.GraphModule, node: fx.Node) -> None:
    """`conv1d(x, w, b, s, p, d, g)` = `conv2d(x[:, :, None, :], w[:, :, None, :], b, (1, s), (0, p), (1, d), g)`
    with the height axis dropped again; both reshapes are views with symbolic sizes (the portable view_copy)."""
    x, w, b, stride, padding, dilation, groups = _conv_args(node)
    out = node.meta["val"]
    with gm.graph.inserting_before(node):
        sizes = view_sizes(gm, x)
        x4 = gm.graph.call_function(_VIEW, (x, [sizes[0], sizes[1], 1, sizes[2]]))
        x4.meta["val"] = x.meta["val"].unsqueeze(2)
        w4 = gm.graph.call_function(_UNSQUEEZE, (w, 2))
        w4.meta["val"] = w.meta["val"].unsqueeze(2)
        y4 = gm.graph.call_function(
            _CONVOLUTION, (x4, w4, b, [1, stride], [0, padding], [1, dilation], False, [0, 0], groups)
        )
        y4.meta = {k: v for k, v in node.meta.items() if k != "val"}
        y4.meta["val"] = out.unsqueeze(2)
        out_sizes = view_sizes(gm, y4)
        y = gm.graph.call_function(_VIEW, (y4, [out_sizes[0], out_sizes[1], out_sizes[3]]))
    y.meta = dict(node.meta)
    node.replace_all_uses_with(y)
    gm.graph.erase_node(node)


class _DepthwiseSeparable(torch.nn.Module):
    """ConvBERT's span-based dynamic convolution input: a depthwise then a pointwise Conv1d over [N, C, L]."""

    def __init__(self, stride: int = 1) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.depthwise = torch.nn.Conv1d(8, 8, kernel_size=3, padding=1, groups=8, bias=False, stride=stride)
        self.pointwise = torch.nn.Conv1d(8, 6, kernel_size=1, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pointwise(self.depthwise(x.transpose(1, 2))).transpose(1, 2)


def _hidden(batch: int, length: int, seed: int = 0) -> dict[str, Any]:
    return {"x": torch.randn(batch, length, 8, generator=torch.Generator().manual_seed(seed))}


def _built(stride: int = 1) -> Built:
    return _DepthwiseSeparable(stride), _hidden(2, 7)


dynamic_conv1d_as_conv2d = NodeRule(
    RuleMeta(
        id="executorch/dynamic-conv1d-as-conv2d",
        why="XNNPACK runs a 1-D convolution as a 2-D one behind an unsqueeze and a squeeze that its partitioner "
        "inserts; with batch and length both dynamic that reshape has two dynamic axes and the lowering fails "
        "with 'XNNPACK reshape only supports 1 dynamic dimension' (ConvBERT's separable convolutions). The same "
        "convolution written as conv2d over a height-1 view, the reshapes as views with symbolic sizes",
        upstream="https://github.com/pytorch/executorch/issues/11449 (squeeze/unsqueeze around conv1d through "
        "XNNPACK's static_reshape, limited to one dynamic dimension)",
        backends=("executorch",),
        models=("convbert",),
        examples=(
            Match(
                lambda: _built(),
                "depthwise (groups = channels, padding 1) then pointwise Conv1d, then another batch and length",
                other_inputs=lambda: _hidden(3, 12, seed=1),
            ),
            Match(
                lambda: _built(stride=2),
                "a strided depthwise Conv1d at an odd length, then another batch and length",
                other_inputs=lambda: _hidden(1, 10, seed=2),
            ),
            NoMatch(lambda: _built(), "the same convolutions exported static"),
        ),
    ),
    predicate=_dynamic_conv1d,
    rewrite=_as_conv2d,
)
