"""Inputs of a `scan` op exported to ONNX, cut from autograd (shared by the scan rules' ONNX variants).

torch.onnx's type-promotion pass re-runs the program on fake tensors with grad enabled and the parameters requiring
grad; a scan op then takes its autograd path, whose fake kernel stacks the SymInts it saves for backward as if they
were per-step outputs (AttributeError: 'SymInt' object has no attribute 'unsqueeze'). Inputs cut from autograd keep
the scan on its inference path; detach changes no value.

A detached *view* (zamba passes per-head slices such as `C[head_idx].transpose(1, 2)`) is no longer a view but still
a window into its base's storage, whose size is an expression in the outer trace's symbols; the scan compiles its body
with a nested dynamo that fakifies the window through that storage and fails ("vr must not be None for symbol
s43"). A copy owns its storage; the values are the same.
"""

from __future__ import annotations

from typing import Any

import torch


def cut_from_autograd(value: Any) -> Any:
    """`value` detached (a view copied) if it is a tensor, else as it is."""
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().clone() if value._is_view() else value.detach()
