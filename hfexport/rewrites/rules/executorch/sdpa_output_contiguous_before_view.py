"""SDPA output strides: keep `view`s of attention outputs valid through to_edge's re-decomposition.

`to_edge` decomposes sdpa into its math form whatever the mask, so only ops traced as `aten.view` break (GPT-2's
Conv1D `x.view(-1, hidden)`); a `reshape` (Llama's, T5's head merge) is decomposed again with the new strides
and needs no copy. ONNX's `fx/gen-view-after-transpose` is a different trigger: torch.onnx keeps sdpa whole
and changes its layout only for a mask computed from a parameter.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from hfexport.rewrites.examples import Built, Match, NoMatch
from hfexport.rewrites.kinds.fx import NodeRule
from hfexport.rewrites.rule import RuleMeta

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
# Ops that pass the SDPA output's memory layout on to a later view (transformers' `transpose(1, 2).reshape(...)`).
_LAYOUT_PASSING = {
    torch.ops.aten.view.default,
    torch.ops.aten.reshape.default,
    torch.ops.aten.transpose.int,
    torch.ops.aten.permute.default,
    torch.ops.aten.contiguous.default,
}


def _views_attention_output(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target is not torch.ops.aten.view.default:
        return False
    source = node.args[0]
    for _ in range(6):
        if not isinstance(source, fx.Node) or source.op != "call_function":
            return False
        if source.target is _SDPA:
            return True
        if source.target not in _LAYOUT_PASSING:
            return False
        source = source.args[0]
    return False


def _contiguous_before_view(gm: fx.GraphModule, node: fx.Node) -> None:
    source = node.args[0]
    with gm.graph.inserting_before(node):
        copy = gm.graph.call_function(
            torch.ops.aten.clone.default, (source,), {"memory_format": torch.contiguous_format}
        )
    copy.meta = dict(source.meta)
    value = source.meta.get("val")
    if isinstance(value, torch.Tensor):
        copy.meta["val"] = value.clone(memory_format=torch.contiguous_format)
    node.replace_input_with(source, copy)


class _AttentionThenView(torch.nn.Module):
    """GPT-2's attention: heads split off a projection, SDPA, heads merged back, Conv1D's `x.view(-1, hidden)`."""

    def __init__(self, attention: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Parameter(torch.randn(16, 48) * 0.2)
        self.proj = torch.nn.Parameter(torch.randn(16, 16) * 0.2)
        self.attention = attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = x.shape
        q, k, v = (x @ self.qkv).view(batch, length, 3, 2, hidden // 2).permute(2, 0, 3, 1, 4).unbind(0)
        if self.attention:
            mixed = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            mixed = q * torch.sigmoid(k) + v
        merged = mixed.transpose(1, 2).reshape(batch, length, hidden)
        return (merged.view(-1, hidden) @ self.proj).view(batch, length, hidden)


def _hidden(batch: int, length: int, seed: int = 0) -> dict[str, Any]:
    return {"x": torch.randn(batch, length, 16, generator=torch.Generator().manual_seed(seed))}


def _built(attention: bool, length: int) -> Built:
    return _AttentionThenView(attention), _hidden(2, length)


sdpa_output_contiguous_before_view = NodeRule(
    RuleMeta(
        id="executorch/sdpa-output-contiguous-before-view",
        why="torch.export records SDPA's output with the fused CPU kernel's strides, so transformers' "
        "`transpose(1, 2).reshape(...)` plus a later `view` (GPT-2's Conv1D) trace as views; to_edge re-traces "
        "SDPA through its math decomposition, whose output strides differ, and fails with 'Cannot view a tensor "
        "with shape ... and strides ...'; a contiguous copy before such a view is valid for either layout",
        upstream="https://github.com/pytorch/pytorch/issues/141107 (SDPA decomposition strides vs. the fused kernel's; "
        "also pytorch/pytorch#136543)",
        backends=("executorch",),
        models=("gpt2",),
        examples=(
            Match(
                lambda: _built(True, 6),
                "SDPA -> transpose -> reshape -> view, then another batch and length",
                other_inputs=lambda: _hidden(3, 11, seed=1),
            ),
            NoMatch(lambda: _built(False, 6), "the same views without attention"),
        ),
    ),
    predicate=_views_attention_output,
    rewrite=_contiguous_before_view,
)
