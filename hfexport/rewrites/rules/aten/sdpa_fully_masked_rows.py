"""Scaled dot-product attention below opset 23 (no ONNX `Attention` op to translate to)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.onnx import AtenOverride
from hfexport.rewrites.rule import RuleMeta


def _sdpa_translation() -> Callable[..., Any]:
    import onnx_ir as ir
    from onnxscript import opset18 as op

    def _repeat_heads(x: Any, groups: Any) -> Any:
        # (B, Hkv, S, E) -> (B, Hkv * groups, S, E), each kv head repeated `groups` times in a row,
        # like torch's enable_gqa (repeat_interleave on the head axis).
        shape = op.Shape(x)
        expanded = op.Expand(
            op.Unsqueeze(x, [2]),
            op.Concat(op.Slice(shape, [0], [2]), groups, op.Slice(shape, [2], [4]), axis=0),
        )
        heads = op.Mul(op.Slice(shape, [1], [2]), groups)
        return op.Reshape(expanded, op.Concat(op.Slice(shape, [0], [1]), heads, op.Slice(shape, [2], [4]), axis=0))

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
        if enable_gqa:
            groups = op.Div(op.Shape(query, start=-3, end=-2), op.Shape(key, start=-3, end=-2))
            key, value = _repeat_heads(key, groups), _repeat_heads(value, groups)
        if scale is None:
            scale = op.Div(op.CastLike(1.0, query), op.Sqrt(op.CastLike(op.Shape(query, start=-1), query)))
        else:
            scale = op.CastLike(scale, query)
        # torch's math kernel scales q and k by sqrt(scale) each before the product; so do we (numerics).
        root = op.Sqrt(scale)
        scores = op.MatMul(op.Mul(query, root), op.Transpose(op.Mul(key, root), perm=[0, 1, 3, 2]))
        minus_inf = op.CastLike(float("-inf"), scores)
        if is_causal:
            rows = op.Unsqueeze(op.Range(0, op.Squeeze(op.Shape(query, start=-2, end=-1)), 1), [1])
            cols = op.Unsqueeze(op.Range(0, op.Squeeze(op.Shape(key, start=-2, end=-1)), 1), [0])
            scores = op.Where(op.LessOrEqual(cols, rows), scores, minus_inf)
        if attn_mask is not None:
            if attn_mask.dtype == ir.DataType.BOOL:
                scores = op.Where(attn_mask, scores, minus_inf)
            else:
                scores = op.Add(scores, attn_mask)
        probs = op.Softmax(scores, axis=-1)
        # A row whose every key is masked: softmax gives NaN, eager SDPA gives zeros. NaN from the inputs
        # themselves still propagates (the row max is NaN, not -inf).
        fully_masked = op.Equal(op.ReduceMax(scores, [-1], keepdims=1), minus_inf)
        probs = op.Where(fully_masked, op.CastLike(0.0, probs), probs)
        return op.MatMul(probs, value)

    return aten_scaled_dot_product_attention


class _Sdpa(torch.nn.Module):
    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.options = options

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> Any:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **self.options)


def _qkv(heads: int = 4, kv_heads: int = 4, length: int = 5, keys: int = 7, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "q": torch.randn(2, heads, length, 8, generator=generator),
        "k": torch.randn(2, kv_heads, keys, 8, generator=generator),
        "v": torch.randn(2, kv_heads, keys, 8, generator=generator),
    }


def _bool_mask_with_a_fully_masked_row() -> tuple[torch.nn.Module, dict[str, Any]]:
    inputs = _qkv()
    mask = torch.rand(2, 1, 5, 7, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[0, 0, 2] = False  # a padded query row: no key to attend to
    return _Sdpa(), {**inputs, "mask": mask}


def _float_mask_with_a_fully_masked_row() -> tuple[torch.nn.Module, dict[str, Any]]:
    module, inputs = _bool_mask_with_a_fully_masked_row()
    mask = inputs["mask"]
    # -inf rows (fully masked) and finfo.min entries (transformers' padding value) in one mask
    additive = torch.where(mask, 0.0, torch.finfo(torch.float32).min)
    additive[0, 0, 2] = float("-inf")
    return module, {**inputs, "mask": additive}


def _gqa_causal_scaled() -> tuple[torch.nn.Module, dict[str, Any]]:
    return _Sdpa(is_causal=True, scale=0.3, enable_gqa=True), _qkv(heads=6, kv_heads=2, length=3, keys=3)


class _ManualAttention(torch.nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.softmax(q @ k.transpose(-1, -2) / 8**0.5, dim=-1) @ v


sdpa_fully_masked_rows = AtenOverride(
    RuleMeta(
        id="aten/sdpa-fully-masked-rows",
        why="below opset 23 torchlib's SDPA gives a fully masked query row (left padding) the mean of V "
        "with a bool mask and NaN with an additive -inf mask; eager gives zeros (observed at opset 18 in ORT "
        "1.32: max abs diff 1.1 on a bool mask; at opset >= 23 the ONNX Attention op is right)",
        upstream="onnxscript==0.7.2 function_libs/torch_lib/ops/nn.py aten_scaled_dot_product_attention (opset 18 "
        "decomposition; its bool-mask handling: https://github.com/microsoft/onnxscript/pull/2479)",
        backends=("onnx",),
        models=("llama",),
        examples=(
            Match(_bool_mask_with_a_fully_masked_row, "bool mask, odd sizes, one fully masked row"),
            Match(_float_mask_with_a_fully_masked_row, "additive mask with -inf and finfo.min rows"),
            Match(
                _gqa_causal_scaled,
                "GQA (6 query heads on 2 kv heads), is_causal, explicit scale; then another length",
                other_inputs=lambda: _qkv(heads=6, kv_heads=2, length=9, keys=9, seed=3),
            ),
            NoMatch(lambda: (_ManualAttention(), _qkv()), "attention written as matmul + softmax"),
        ),
    ),
    target="aten.scaled_dot_product_attention.default",
    translation=_sdpa_translation,
    max_opset=22,
)
