"""Tensor checks that transformers' `torch_compilable_check` leaves in the graph (`torch._check_tensor_all`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def is_all_true_translation() -> Callable[..., Any]:
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


class _CheckSelects(torch.nn.Module):
    """The check's value selects the output: torch.onnx drops the assertion a real check feeds (so a
    translation that ignores its input would pass `_CheckedScale`); here a wrong truth value changes the result."""

    def forward(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        ok = torch.ops.aten._is_all_true((tokens >= 0) & (features.sum(-1) == features.sum(-1)))
        return torch.where(ok, features * 2, features - 1)


def selects_true() -> tuple[torch.nn.Module, dict[str, Any]]:
    return _CheckSelects(), checked()[1]


def selects_false() -> dict[str, Any]:
    """Other sizes, one negative token: the check is false (a NaN feature would make it false too)."""
    inputs = checked_odd()
    inputs["tokens"][1, 4] = -1.0
    return inputs


class Unchecked(torch.nn.Module):
    def forward(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return features * 2 + tokens.unsqueeze(-1)


def checked() -> tuple[torch.nn.Module, dict[str, Any]]:
    generator = torch.Generator().manual_seed(0)
    return _CheckedScale(), {
        "tokens": torch.arange(6.0).reshape(2, 3),
        "features": torch.randn(2, 3, 5, generator=generator),
    }


def checked_odd() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(1)
    return {"tokens": torch.arange(14.0).reshape(2, 7), "features": torch.randn(2, 7, 3, generator=generator)}


def squeeze_is_noop(self: Any, dim: int) -> bool:
    """Whether torch.squeeze(dim) leaves `self` as it is: a dimension that is not 1 (and a 0-d tensor).

    A symbolic size counts as not 1: torch decides squeeze while tracing (`guard_or_false(size == 1)`), so a
    size still symbolic in the exported program is one torch proved or guarded to differ from 1 (a size-1
    input axis is specialised to the integer 1), and the program's own shapes keep that axis.
    """
    shape = self.shape
    if shape is None:
        return False
    if len(shape) == 0:
        return True
    size = shape[dim % len(shape)]
    if isinstance(size, int):
        return size != 1
    # onnx_ir.SymbolicDim: a named size is a torch symbol; an unnamed one carries no fact, so keep torchlib's.
    return isinstance(getattr(size, "value", None), str)


def squeeze_dim_translation() -> Callable[..., Any]:
    from onnxscript import opset18 as op

    def aten_squeeze_dim(self: Any, dim: int) -> Any:
        if squeeze_is_noop(self, dim):
            return op.Identity(self)  # ONNX Squeeze would reject an axis whose size is not 1
        return op.Squeeze(self, [dim])

    return aten_squeeze_dim


class SqueezeTokens(torch.nn.Module):
    """Pixtral-style: `features.squeeze(0)` on [tokens, hidden] features, a no-op when tokens != 1."""

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return features.reshape(-1, features.shape[-1]).squeeze(0) * 3


class SqueezeBatch(torch.nn.Module):
    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return features.squeeze(0) * 3


class SqueezeAll(torch.nn.Module):
    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return features.squeeze() * 3
