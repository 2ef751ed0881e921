"""Tensor checks that transformers' `torch_compilable_check` leaves in the graph (`torch._check_tensor_all`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.onnx_kinds import AtenOverride
from hfexport.rewrites.rule import RuleMeta


def _is_all_true_translation() -> Callable[..., Any]:
    from onnxscript import opset18 as op

    def aten_is_all_true(self: Any) -> Any:
        # All elements true: the minimum of the values as 0/1 integers is 1. An empty tensor reduces to the
        # largest int32 (ReduceMin's identity), true as torch.all gives for no elements.
        as_int = op.Cast(self, to=6)  # INT32
        return op.Cast(op.ReduceMin(op.Reshape(as_int, [-1]), keepdims=0), to=9)  # BOOL

    return aten_is_all_true


class _CheckedScale(torch.nn.Module):
    """Scales image features after checking they fill the image tokens, as LLaVA-style merges do."""

    def forward(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        torch._check_tensor_all((tokens >= 0) & (features.sum(-1) == features.sum(-1)))
        return features * 2 + tokens.unsqueeze(-1)


class _Unchecked(torch.nn.Module):
    def forward(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return features * 2 + tokens.unsqueeze(-1)


def _checked() -> tuple[torch.nn.Module, dict[str, Any]]:
    generator = torch.Generator().manual_seed(0)
    return _CheckedScale(), {
        "tokens": torch.arange(6.0).reshape(2, 3),
        "features": torch.randn(2, 3, 5, generator=generator),
    }


def _checked_odd() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(1)
    return {"tokens": torch.arange(14.0).reshape(2, 7), "features": torch.randn(2, 7, 3, generator=generator)}


is_all_true = AtenOverride(
    RuleMeta(
        id="aten/is-all-true",
        why="transformers' torch_compilable_check calls torch._check_tensor_all while tracing (LLaVA checks "
        "that the image features fill the image tokens), which leaves aten._is_all_true in the graph; "
        "torch.onnx (2.13, onnxscript 0.7.2) has no translation for it and the export fails "
        "('No ONNX function found for aten._is_all_true')",
        upstream="onnxscript 0.7.2 torchlib: no aten::_is_all_true",
        backends=("onnx",),
        models=("llava",),
        examples=(
            Match(_checked, "a tensor check before the output; then other, odd sizes", other_inputs=_checked_odd),
            NoMatch(lambda: (_Unchecked(), _checked()[1]), "the same computation without a check"),
        ),
    ),
    target="aten._is_all_true.default",
    translation=_is_all_true_translation,
)


def _squeeze_is_noop(self: Any, dim: int) -> bool:
    """torch.squeeze(dim) leaves a dimension that is not 1 alone (and a 0-d tensor as it is)."""
    shape = self.shape
    if shape is None:
        return False
    if len(shape) == 0:
        return True
    size = shape[dim % len(shape)]
    return isinstance(size, int) and size != 1


def _squeeze_dim_translation() -> Callable[..., Any]:
    from onnxscript import opset18 as op

    def aten_squeeze_dim(self: Any, dim: int) -> Any:
        if _squeeze_is_noop(self, dim):
            return op.Identity(self)  # ONNX Squeeze would reject an axis whose size is not 1
        return op.Squeeze(self, [dim])

    return aten_squeeze_dim


class _SqueezeTokens(torch.nn.Module):
    """Pixtral-style: `features.squeeze(0)` on [tokens, hidden] features, a no-op when tokens != 1."""

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return features.reshape(-1, features.shape[-1]).squeeze(0) * 3


class _SqueezeBatch(torch.nn.Module):
    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return features.squeeze(0) * 3


class _SqueezeAll(torch.nn.Module):
    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return features.squeeze() * 3


squeeze_dim_noop = AtenOverride(
    RuleMeta(
        id="aten/squeeze-dim-noop",
        why="torch.squeeze(x, dim) leaves a dimension whose size is not 1 unchanged; torchlib translates it to ONNX "
        "Squeeze(axes=[dim]) regardless, which ONNX Runtime rejects when that size is not 1 ('Dimension of input 0 "
        "must be 1 instead of 8'; Mistral3's image features, squeezed on the token axis). Hits count only those "
        "no-op squeezes; a squeeze of a size-1 axis keeps torchlib's Squeeze",
        upstream="onnxscript 0.7.2 torchlib aten_squeeze_dim: Squeeze without checking the size",
        backends=("onnx",),
        models=("mistral3", "lighton_ocr"),
        examples=(
            Match(lambda: (_SqueezeTokens(), {"features": torch.randn(1, 7, 5)}), "squeeze(0) of [7, 5]: a no-op"),
            NoMatch(lambda: (_SqueezeAll(), {"features": torch.randn(1, 3)}), "squeeze() of every size-1 axis"),
            NoMatch(lambda: (_SqueezeBatch(), {"features": torch.randn(1, 3)}), "squeeze(0) of a size-1 axis"),
        ),
    ),
    target="aten.squeeze.dim",
    translation=_squeeze_dim_translation,
    counts=_squeeze_is_noop,
)
