"""A patch-embedding convolution over a batch of data-dependent size becomes a reshape and a matrix product.

SmolVLM (and Idefics3) drop all-zero padding images before the vision tower with a boolean index
(`pixel_values[real_images_inds]`), so the tower's batch is a data-dependent (unbacked) size. Inductor's layout
optimisation then gives the patch embedding's convolution a channels-last output, while the kernels that read it
index it as contiguous: every consumer of the convolution (its flatten, a copy, `x * 1`) reads wrong values (3.3
off eager on a tiny model), though the convolution's output itself is right. The same program with
`layout_optimization` off, or on a batch of plain symbolic size, matches eager.

A convolution whose kernel equals its stride (no padding, no dilation, one group, a height and width the kernel
divides) is a patchify: the rule rewrites it as the patches (`reshape` and `permute` of the input) times the flattened
kernel (`mm`, plus the bias), laid out back as the convolution's `[batch, channels, rows, columns]`. No convolution
is left for the layout optimisation; the sum is the same products in another order (float rounding only).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.fx import NodeRule
from hfexport.rewrites.rule import RuleMeta

aten = torch.ops.aten
_CONVS = (aten.conv2d.default, aten.conv2d.padding)


def _argument(node: fx.Node, index: int, name: str, default: Any) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _patchify(node: fx.Node) -> tuple[int, int] | None:
    """The kernel (rows, columns) of a 2-D convolution over a data-dependent batch that is a patchify, else None."""
    if node.op != "call_function" or node.target not in _CONVS:
        return None
    source, weight = node.args[0], node.args[1]
    x = source.meta.get("val") if isinstance(source, fx.Node) else None
    w = weight.meta.get("val") if isinstance(weight, fx.Node) else None
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor) or x.dim() != 4:
        return None
    if not isinstance(x.shape[0], torch.SymInt) or not free_unbacked_symbols(x.shape[0]):
        return None
    kh, kw = w.shape[2], w.shape[3]
    height, width = x.shape[2], x.shape[3]
    if not all(isinstance(v, int) for v in (kh, kw, height, width, w.shape[1])):
        return None
    stride = list(_argument(node, 3, "stride", [1, 1]))
    padding = _argument(node, 4, "padding", [0, 0])
    dilation = list(_argument(node, 5, "dilation", [1, 1]))
    groups = _argument(node, 6, "groups", 1)
    no_padding = padding == "valid" or list(padding) in ([0, 0], [0])
    if stride != [kh, kw] or not no_padding or dilation not in ([1, 1], [1]) or groups != 1:
        return None
    return None if height % kh or width % kw else (kh, kw)


def _call(graph: fx.Graph, target: Any, args: tuple, value: Any) -> fx.Node:
    node = graph.call_function(target, args)
    node.meta["val"] = value
    return node


def _as_matmul(gm: fx.GraphModule, node: fx.Node) -> None:
    kh, kw = _patchify(node)  # type: ignore[misc]
    graph = gm.graph
    source, weight = node.args[0], node.args[1]
    bias = _argument(node, 2, "bias", None)
    x, w = source.meta["val"], weight.meta["val"]
    channels, rows, columns, out = x.shape[1], x.shape[2] // kh, x.shape[3] // kw, w.shape[0]
    batch_value = x.shape[0]
    with graph.inserting_before(node):
        batch = _call(graph, aten.sym_size.int, (source, 0), batch_value)
        shape = [batch, channels, rows, kh, columns, kw]
        value = aten.reshape.default(x, [batch_value, *shape[1:]])
        split = _call(graph, aten.reshape.default, (source, shape), value)
        value = aten.permute.default(value, [0, 2, 4, 1, 3, 5])
        moved = _call(graph, aten.permute.default, (split, [0, 2, 4, 1, 3, 5]), value)
        patches_shape = [batch, rows * columns, channels * kh * kw]
        value = aten.reshape.default(value, [batch_value, *patches_shape[1:]])
        patches = _call(graph, aten.reshape.default, (moved, patches_shape), value)
        flat_value = aten.reshape.default(w, [out, channels * kh * kw])
        flat = _call(graph, aten.reshape.default, (weight, [out, channels * kh * kw]), flat_value)
        kernel_value = aten.t.default(flat_value)
        kernel = _call(graph, aten.t.default, (flat,), kernel_value)
        value = aten.matmul.default(value, kernel_value)
        product = _call(graph, aten.matmul.default, (patches, kernel), value)
        if isinstance(bias, fx.Node):
            value = aten.add.Tensor(value, bias.meta["val"])
            product = _call(graph, aten.add.Tensor, (product, bias), value)
        grid_shape = [batch, rows, columns, out]
        value = aten.reshape.default(value, [batch_value, *grid_shape[1:]])
        grid = _call(graph, aten.reshape.default, (product, grid_shape), value)
        value = aten.permute.default(value, [0, 3, 1, 2])
        result = _call(graph, aten.permute.default, (grid, [0, 3, 1, 2]), value)
    node.replace_all_uses_with(result)
    graph.erase_node(node)
    graph.lint()
    gm.recompile()


class _PatchEmbedAfterPadding(torch.nn.Module):
    """SmolVLM's vision input: padding images (all zeros) dropped by a boolean index, then a patch embedding."""

    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.patch = torch.nn.Conv2d(3, 32, 4, stride=4, bias=bias)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        real = (pixel_values == 0.0).sum(dim=(-1, -2, -3)) != pixel_values.shape[1:].numel()
        return self.patch(pixel_values[real]).flatten(2).transpose(1, 2)


class _PatchEmbed(_PatchEmbedAfterPadding):
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.patch(pixel_values).flatten(2).transpose(1, 2)


def _images(count: int = 2) -> dict[str, torch.Tensor]:
    torch.manual_seed(1)
    return {"pixel_values": torch.randn(count, 3, 32, 32)}


patch_conv_on_data_dependent_batch_as_matmul = NodeRule(
    RuleMeta(
        id="fx/patch-conv-on-data-dependent-batch-as-matmul",
        why="AOTInductor computes wrong values after a convolution whose batch is a data-dependent size (SmolVLM's "
        "vision tower, after the boolean index that drops padding images): Inductor's layout optimisation gives the "
        "convolution a channels-last output that the kernels reading it index as contiguous (logits 0.54 off eager "
        "on the corpus's tiny SmolVLM). A patchify convolution (kernel = stride) becomes patches times the "
        "flattened kernel, which leaves no convolution to lay out",
        upstream="torch==2.13.0 torch/_inductor/graph.py (GraphLowering.decide_layout_opt and the convolution "
        "lowering's channels-last output on an unbacked batch; no issue filed found)",
        backends=("aoti",),
        models=("smolvlm", "idefics3"),
        examples=(
            Match(
                lambda: (_PatchEmbedAfterPadding(), _images()),
                "a patch embedding after padding images are dropped (SmolVLM's vision input)",
                slow=True,
            ),
            NoMatch(lambda: (_PatchEmbed(), _images()), "a patch embedding on the plain batch", slow=True),
        ),
    ),
    predicate=lambda node: _patchify(node) is not None,
    rewrite=_as_matmul,
)
