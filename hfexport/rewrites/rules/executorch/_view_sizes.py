"""Sizes as view arguments, for the ExecuTorch rules that write views XNNPACK's static reshape takes."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_symbols

_SYM_SIZE = torch.ops.aten.sym_size.int


def view_sizes(gm: fx.GraphModule, tensor: fx.Node) -> list[Any]:
    """`tensor`'s sizes as view arguments: ints for static axes, `sym_size` nodes for dynamic ones."""
    sizes: list[Any] = []
    for axis, size in enumerate(tensor.meta["val"].shape):
        if free_symbols(size):
            node = gm.graph.call_function(_SYM_SIZE, (tensor, axis))
            node.meta["val"] = size
            sizes.append(node)
        else:
            sizes.append(int(size))
    return sizes


def inferred_sizes(value: Any) -> list[int] | None:
    """`value`'s sizes as view arguments XNNPACK takes: ints, and -1 on its one dynamic axis; None with more than one
    dynamic axis, or with a static size of 0 (where -1 could not be inferred: numel 0 fits any size there)."""
    sizes = [-1 if free_symbols(size) else int(size) for size in value.shape]
    return None if sizes.count(-1) > 1 or 0 in sizes else sizes
