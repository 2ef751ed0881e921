"""Scaled dot-product attention as the OpenVINO CPU plugin computes it."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from hfexport.rewrites.example_models import left_padded_llama
from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.fx import NodeRule
from hfexport.rewrites.rule import RuleMeta

_SDPA = torch.ops.aten.scaled_dot_product_attention.default
_DONE = "hfexport.openvino.masked_rows"


def _mask(node: fx.Node) -> Any:
    return node.args[3] if len(node.args) > 3 else node.kwargs.get("attn_mask")


def _has_mask(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target is not _SDPA or node.meta.get(_DONE):
        return False
    mask = _mask(node)
    value = mask.meta.get("val") if isinstance(mask, fx.Node) else None
    return isinstance(value, torch.Tensor) and (value.dtype == torch.bool or value.is_floating_point())


_ATEN = torch.ops.aten
# Layout ops an attention output commonly goes through next: the zeroing can follow one of them exactly.
_SWAPS = (_ATEN.transpose.int, _ATEN.permute.default)
_RESHAPES = (_ATEN.view.default, _ATEN.reshape.default, _ATEN._unsafe_view.default)


def _layout_user(node: fx.Node) -> fx.Node | None:
    """The attention output's only user when it is a transpose, permute or reshape of it, else None."""
    users = list(node.users)
    if len(users) != 1 or users[0].op != "call_function" or users[0].args[0] is not node:
        return None
    return users[0] if users[0].target in (*_SWAPS, *_RESHAPES) else None


def _rows_kept_like(graph: fx.Graph, attends: fx.Node, node: fx.Node, user: fx.Node) -> fx.Node:
    """`attends` ((..., L, 1), broadcasting to the attention output) laid out as `user` lays out the output."""
    if user.target not in _SWAPS:
        # A reshape can merge the broadcast axes: give the flags the output's full shape first.
        sizes = [graph.call_function(_ATEN.sym_size.int, (node, d)) for d in range(node.meta["val"].dim())]
        attends = graph.call_function(_ATEN.expand.default, (attends, sizes))
    return graph.call_function(user.target, (attends, *user.args[1:]), dict(user.kwargs))


def _zero_fully_masked_rows(gm: fx.GraphModule, node: fx.Node) -> None:
    mask = _mask(node)
    graph = gm.graph
    # Zero the rows after the op that lays the output out next, when there is one: a Select right after the
    # attention is fused into the CPU plugin's MHA snippet, which then computes wrong values at head_dim 128
    # and 256 (up to 10 off, or NaN, from 32 tokens on; 64-112 are right).
    user = _layout_user(node) if mask.meta["val"].dim() == node.meta["val"].dim() else None
    target = node if user is None else user
    with graph.inserting_before(target.next):
        keeps = mask
        if mask.meta["val"].is_floating_point():
            # An additive mask masks a key with -inf only; NaN entries stay "kept" so NaN still propagates.
            keeps = graph.call_function(_ATEN.ne.Scalar, (mask, float("-inf")))
        # (..., L, 1): whether query row L attends to any key; broadcasts over heads and the value width.
        attends = graph.call_function(_ATEN.any.dim, (keeps, -1, True))
        if user is not None:
            attends = _rows_kept_like(graph, attends, node, user)
        zeroed = graph.call_function(_ATEN.where.ScalarOther, (attends, target, 0.0))
    target.replace_all_uses_with(zeroed, delete_user_cb=lambda u: u is not zeroed)
    node.meta[_DONE] = True


class _Attention(torch.nn.Module):
    def __init__(self, additive: bool = False) -> None:
        super().__init__()
        self.additive = additive

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        mask = torch.zeros(keep.shape).masked_fill(~keep, float("-inf")) if self.additive else keep
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _attention_inputs(batch: int, length: int, padded: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    keep = torch.ones(length, length, dtype=torch.bool).tril()[None, None].repeat(batch, 1, 1, 1)
    keep[0, :, :, :padded] = False  # left padding: the first `padded` query rows of row 0 attend to nothing
    return {
        "q": torch.randn(batch, 4, length, 8, generator=generator),
        "k": torch.randn(batch, 4, length, 8, generator=generator),
        "v": torch.randn(batch, 4, length, 8, generator=generator),
        "keep": keep,
    }


sdpa_fully_masked_rows = NodeRule(
    RuleMeta(
        id="openvino/sdpa-fully-masked-rows",
        why="the OpenVINO CPU plugin returns NaN for an attention query row whose mask is all False (or -inf), "
        "where torch returns 0; a left-padded batch has such rows, and the NaN spreads to the whole sequence "
        "through the next layer. The zeroing goes after the output's transpose back to (batch, length, heads, "
        "dim) when there is one: a Select right after the attention is fused into the CPU plugin's MHA snippet "
        "(OpenVINO 2026.4), which at head_dim 128 and 256 returns values up to 10 off, or NaN, from 32 tokens "
        "on (measured on an AVX-512 CPU without AMX; head_dim 64-112 are right)",
        upstream="https://github.com/openvinotoolkit/openvino/issues/35959 (fix proposed in "
        "https://github.com/openvinotoolkit/openvino/pull/36016)",
        backends=("openvino",),
        models=("llama", "qwen3", "mistral", "gemma2"),
        examples=(
            Match(
                lambda: (_Attention(), _attention_inputs(2, 5, padded=3)),
                "boolean mask, left-padded rows; then another batch and length",
                other_inputs=lambda: _attention_inputs(3, 9, padded=4, seed=1),
            ),
            Match(
                lambda: (_Attention(additive=True), _attention_inputs(2, 6, padded=2)),
                "additive -inf mask",
            ),
            Match(left_padded_llama, "a left-padded Llama batch"),
            Match(
                # The width at which the CPU plugin's MHA snippet goes wrong when the zeroing is fused into it.
                lambda: left_padded_llama(tokens=64, padded=5, head_dim=128),
                "head_dim 128 at 64 tokens: the zeroing follows the heads' transpose, outside the MHA snippet",
            ),
            NoMatch(
                lambda: (
                    torch.nn.MultiheadAttention(8, 2, batch_first=True).eval(),
                    {
                        "query": torch.randn(2, 3, 8),
                        "key": torch.randn(2, 3, 8),
                        "value": torch.randn(2, 3, 8),
                        "need_weights": False,
                    },
                ),
                "attention without a mask",
            ),
        ),
    ),
    predicate=_has_mask,
    rewrite=_zero_fully_masked_rows,
)
