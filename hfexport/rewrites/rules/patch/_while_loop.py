"""Helpers of the patches that run a recurrence as a `torch._higher_order_ops.while_loop` for OpenVINO (its PyTorch
frontend translates `while_loop` to a `Loop`, and has no translator for `scan`): `patch/mamba-selective-scan-hop`
and `patch/rglru-recurrence-scan`, their OpenVINO variants."""

from __future__ import annotations

import torch


def owned_carry(value: torch.Tensor) -> torch.Tensor:
    """`value` as a while_loop carry: a carried input must have the strides of the body's output for it (a clone,
    contiguous), so a transposed or sliced input (zamba's per-head slices are windows into storage whose size is an
    expression of the outer trace's symbols) is copied to a contiguous tensor that owns its storage; the values are
    the same."""
    if value._is_view() or not value.is_contiguous():
        return value.clone(memory_format=torch.contiguous_format)
    return value
