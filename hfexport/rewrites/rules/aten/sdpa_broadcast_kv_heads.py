"""Scaled dot-product attention whose key/value carry one head that broadcasts over the query heads (opset >= 23)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.onnx import AtenOverride
from hfexport.rewrites.rule import RuleMeta


def _heads(value: Any) -> Any:
    shape = value.shape
    return shape[1] if shape is not None and len(shape) == 4 else None


def _broadcasts_kv(query: Any, key: Any, value: Any, *args: Any, enable_gqa: bool = False, **kwargs: Any) -> bool:
    """Whether K and V have one head (static) that broadcasts over more query heads, without enable_gqa.

    torch's SDPA broadcasts the head axis like a batch axis (Falcon's multi-query attention passes
    [B, 1, S, E] keys for [B, H, S, E] queries); with one kv head that is exactly GQA with H groups.
    """
    if len(args) >= 4:
        enable_gqa = args[3]
    q, k, v = _heads(query), _heads(key), _heads(value)
    # A symbolic query head count also counts: at run time it may be 1, where Attention's GQA is plain MHA.
    return not enable_gqa and k == 1 and v == 1 and q is not None and q != 1


def _sdpa_translation() -> Callable[..., Any]:
    from onnxscript import opset23 as op
    from torch.onnx._internal.exporter._torchlib.ops.nn import aten_scaled_dot_product_attention_23

    translate = getattr(aten_scaled_dot_product_attention_23, "function", aten_scaled_dot_product_attention_23)

    def aten_scaled_dot_product_attention(
        query: Any,
        key: Any,
        value: Any,
        attn_mask: Any = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Any:
        if dropout_p == 0 and not (is_causal and attn_mask is not None) and _broadcasts_kv(query, key, value):
            # The ONNX Attention op takes 4D inputs with q heads a multiple of kv heads (GQA); one kv head
            # repeated for every query head is the broadcast. (torch.onnx's own call asserts the head counts
            # in Python, which a symbolic query head count cannot pass.)
            output, _, _, _ = op.Attention(query, key, value, attn_mask, scale=scale, is_causal=is_causal)
            return output
        return translate(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    return aten_scaled_dot_product_attention


class _Sdpa(torch.nn.Module):
    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.options = options

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> Any:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **self.options)


def _qkv(heads: int, kv_heads: int, length: int, keys: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "q": torch.randn(2, heads, length, 8, generator=generator),
        "k": torch.randn(2, kv_heads, keys, 8, generator=generator),
        "v": torch.randn(2, kv_heads, keys, 8, generator=generator),
    }


def _multi_query_bool_mask(length: int = 5, keys: int = 7, seed: int = 0) -> dict[str, torch.Tensor]:
    """Falcon-style: 4 query heads on one kv head, a [B, 1, L, S] bool mask with a padded (masked) key."""
    inputs = _qkv(4, 1, length, keys, seed)
    mask = torch.ones(2, 1, length, keys, dtype=torch.bool).tril(keys - length)
    mask[1, :, :, 0] = False  # left padding in the second sequence
    return {**inputs, "mask": mask}


def _multi_query_float_mask() -> dict[str, torch.Tensor]:
    inputs = _multi_query_bool_mask(length=3, keys=3, seed=2)
    inputs["mask"] = torch.where(inputs["mask"], 0.0, torch.finfo(torch.float32).min)
    return inputs


sdpa_broadcast_kv_heads = AtenOverride(
    RuleMeta(
        id="aten/sdpa-broadcast-kv-heads",
        why="Falcon's multi-query attention calls SDPA with one key/value head for all query heads "
        "([B, 1, S, E] against [B, H, S, E]) and relies on torch broadcasting the head axis, without "
        "enable_gqa; torch.onnx's opset-23 SDPA (the ONNX Attention op) asserts equal head counts and the "
        "export fails ('SDPA (MHA) requires q_num_heads = kv_num_heads', causal_lm/falcon, encoder/falcon). "
        "One kv head broadcast over H query heads is GQA with H groups, so the override passes enable_gqa",
        upstream="torch==2.13 torch/onnx/_internal/exporter/_torchlib/ops/nn.py aten_scaled_dot_product_attention_23 "
        "(MHA branch requires equal heads; eager SDPA broadcasts the head axis)",
        backends=("onnx",),
        models=("falcon",),
        examples=(
            Match(
                lambda: (_Sdpa(), _multi_query_bool_mask()),
                "4 query heads on 1 kv head, bool mask with a padded key, odd sizes; then other lengths",
                other_inputs=lambda: _multi_query_bool_mask(length=9, keys=11, seed=1),
            ),
            Match(lambda: (_Sdpa(), _multi_query_float_mask()), "1 kv head, additive finfo.min mask"),
            Match(
                lambda: (_Sdpa(is_causal=True, scale=0.3), _qkv(3, 1, 5, 5)),
                "1 kv head, is_causal, explicit scale",
                other_inputs=lambda: _qkv(3, 1, 13, 13, seed=4),
            ),
            NoMatch(lambda: (_Sdpa(), _qkv(4, 4, 5, 7)), "as many kv heads as query heads"),
            NoMatch(lambda: (_Sdpa(enable_gqa=True), _qkv(4, 2, 5, 7)), "GQA with enable_gqa (2 kv heads)"),
        ),
    ),
    target="aten.scaled_dot_product_attention.default",
    translation=_sdpa_translation,
    min_opset=23,
    counts=_broadcasts_kv,
)
