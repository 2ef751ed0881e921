"""Helpers shared by the delta-rule chunk scans (`patch/gated-delta-chunk-scan-hop`, `patch/kimi-delta-chunk-scan-hop`).

Both upstream chunk kernels solve the same unit-lower-triangular "UT" system per chunk by forward substitution
with in-place row writes; only how the system's entries are decayed differs (per head vs per key channel).
"""

from __future__ import annotations

import torch


def unit_lower_inverse(ut_system: torch.Tensor) -> torch.Tensor:
    """(I + strict_lower(ut_system))^-1 without a triangular solver and without a loop over rows.

    Upstream's export path builds this inverse by forward substitution with in-place row writes (63 unrolled
    steps whose broadcast checks pin the chunk count). With N = -strict_lower, N is nilpotent (N^C = 0), so
    (I - N)^-1 = I + N + ... + N^(C-1) = (I + N)(I + N^2)(I + N^4)...: about log2(C) squarings.
    """
    size = ut_system.shape[-1]
    nilpotent = -ut_system.tril(-1)
    inverse = torch.eye(size, dtype=ut_system.dtype, device=ut_system.device) + nilpotent
    power, covered = nilpotent, 2  # `inverse` holds the powers 0 .. covered-1
    while covered < size:
        power = power @ power  # N^covered
        inverse = inverse + inverse @ power
        covered *= 2
    return inverse


def detached_scan_input(value: torch.Tensor) -> torch.Tensor:
    """A scan input cut from autograd, for torch.onnx (the `*-onnx` variants of the chunk-scan rules).

    torch.onnx's type-promotion pass re-runs the program on fake tensors with grad enabled, and a scan whose inputs
    require grad takes its autograd path, whose fake kernel fails ('SymInt' object has no attribute 'unsqueeze');
    see the ONNX variant of patch/mamba-selective-scan-hop. A detached view still windows its base's storage, whose
    size the scan's nested trace cannot fakify, so views are copied. Neither changes a value.
    """
    return value.detach().clone() if value._is_view() else value.detach()
