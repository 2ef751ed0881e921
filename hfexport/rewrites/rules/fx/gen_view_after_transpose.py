"""A reshape of a transposed attention output gets an explicit contiguous copy, so it survives decomposition.

T5's attention merges its heads as `sdpa(...)` -> `reshape` -> `transpose(1, 2)` -> `reshape(batch, length, -1)`
with no `contiguous()` in between. torch.onnx runs `run_decompositions` on the captured graph: the last reshape
is decomposed against the strides of the fake sdpa kernel, whose output is laid out `[batch, length, heads, dim]`
(the transpose looks contiguous, so the reshape becomes an `aten.view`), while sdpa itself is decomposed into
its math form with an ordinary `[batch, heads, length, dim]` output. The view then fails under symbolic shapes:
"Cannot view a tensor with shape [s72, s53, 4, 8] and strides (32*s53, 8, 8*s53, 1) as a tensor with shape
(s72, s53, 32)".

The rule puts `aten.clone(memory_format=torch.contiguous_format)` between such a `transpose`/`permute` of an
sdpa output (through reshapes) and the `view`/`reshape` of it. A clone has the same values whatever the strides,
so the result is exact; ONNX has no strides (the clone is an Identity that the optimiser drops). Attention code
that calls `.contiguous()` itself (Llama and most models) has the copy already and is not matched.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.fx import FxNodeRule
from hfexport.rewrites.rule import RuleMeta

aten = torch.ops.aten
_STRIDE_CHANGING = (aten.transpose.int, aten.permute.default)
_RESHAPES = (aten.view.default, aten.reshape.default)
_SDPA = (
    aten.scaled_dot_product_attention.default,
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_efficient_attention.default,
    aten._scaled_dot_product_flash_attention.default,
)


def _from_sdpa(node: Any) -> bool:
    """Whether `node` is an sdpa output, possibly through reshapes and getitem (its layout is the fake kernel's)."""
    while isinstance(node, fx.Node) and node.op == "call_function":
        if node.target in _SDPA:
            return True
        if node.target not in (*_RESHAPES, operator.getitem):
            return False
        node = node.args[0]
    return False


def _view_of_transpose(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target not in _RESHAPES:
        return False
    source = node.args[0]
    return (
        isinstance(source, fx.Node)
        and source.op == "call_function"
        and source.target in _STRIDE_CHANGING
        and _from_sdpa(source.args[0])
    )


def _copy_before_view(gm: fx.GraphModule, node: fx.Node) -> None:
    source = node.args[0]
    with gm.graph.inserting_before(node):
        copy = gm.graph.call_function(aten.clone.default, (source,), {"memory_format": torch.contiguous_format})
    if "val" in source.meta:
        copy.meta["val"] = source.meta["val"].clone(memory_format=torch.contiguous_format)
    node.args = (copy, *node.args[1:])
    gm.graph.lint()
    gm.recompile()


class _AttentionMerge(torch.nn.Module):
    """T5-style: sdpa, transpose back to [batch, length, heads, dim], merge the heads with `reshape`."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1) * 2


class _TransposeMerge(torch.nn.Module):
    """The same merge of a tensor that is not an attention output: its layout does not change under
    decomposition, so it is left alone."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return (q + v).transpose(1, 2).reshape(q.shape[0], q.shape[2], -1) * 2


class _ContiguousMerge(torch.nn.Module):
    """A reshape of a contiguous tensor: recorded as a plain view of it, not of a transpose."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 2).reshape(x.shape[0], -1)


def _qkv(batch: int = 2, length: int = 5) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(batch, 4, length, 8, generator=generator) for name in ("q", "k", "v")}


gen_view_after_transpose = FxNodeRule(
    meta=RuleMeta(
        id="fx/gen-view-after-transpose",
        why="an sdpa output's transpose is contiguous at trace time (the fake kernel's memory order), so "
        "`.contiguous().reshape` is recorded as aten.view; after run_decompositions (torch.onnx) the sdpa math "
        "output is laid out [b, h, l, d] and the view fails: 'Cannot view a tensor with shape [...] and strides "
        "[...]' (T5's encoder and decoder)",
        upstream="https://github.com/pytorch/pytorch/issues/141107 (a view of the sdpa output's transpose fails once "
        "run_decompositions lays the math output out differently; also pytorch/pytorch#136543)",
        backends=("onnx",),
        models=("t5", "mt5", "longt5"),
        examples=(
            Match(lambda: (_AttentionMerge(), _qkv()), "sdpa, transpose, merge heads", other_inputs=lambda: _qkv(3, 9)),
            NoMatch(lambda: (_TransposeMerge(), _qkv()), "a transpose of a sum, merged: not an attention output"),
            NoMatch(lambda: (_ContiguousMerge(), {"x": torch.randn(2, 3, 4)}), "a view of a contiguous tensor"),
        ),
    ),
    predicate=_view_of_transpose,
    rewrite=_copy_before_view,
)
