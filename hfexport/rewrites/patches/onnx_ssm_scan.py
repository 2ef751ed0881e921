"""Mamba-1 selective scan for the ONNX backend: the `scan` of `patch/mamba-selective-scan-hop`, detached.

That rule is scoped to the dynamo backend, so an ONNX export captured transformers' unrolled
`for index in range(seq_len)` loop, which specialises the sequence axis to the sample length (falcon_mamba's
ONNX model declared `input_ids: [batch, 8]` and ORT rejected the grown input). With the scan op instead,
torch.onnx's type-promotion pass (step 2/3) failed on it (see `scan_selective_detached`); with the scan's
inputs detached, torch.onnx translates it to an ONNX `Scan` loop.
"""

from __future__ import annotations

from typing import Any

import torch

from hfexport.rewrites.patches.ssm_scan import EXAMPLES, scan_selective
from hfexport.rewrites.patching import ModuleFunctionPatch
from hfexport.rewrites.rule import RuleMeta

# Only the families checked in ORT: zamba's export with this scan fails in torch.export ("vr must not be
# None for symbol ..." in run_flattened_scan), so its copy is left to the unrolled loop for now.
_VERIFIED = ("falcon_mamba",)


def scan_selective_detached(original: Any, *args: Any, **kwargs: Any) -> Any:
    # torch.onnx's type-promotion pass re-runs the program on fake tensors with grad enabled and the
    # parameters requiring grad; the scan op then takes its autograd path, whose fake kernel stacks the
    # SymInts it saves for backward as if they were per-step outputs (AttributeError: 'SymInt' object has
    # no attribute 'unsqueeze'). Inputs cut from autograd keep the scan on its inference path; detach
    # changes no value.
    def cut(value: Any) -> Any:
        return value.detach() if isinstance(value, torch.Tensor) else value

    return scan_selective(original, *map(cut, args), **{k: cut(v) for k, v in kwargs.items()})


mamba_selective_scan_onnx = ModuleFunctionPatch(
    RuleMeta(
        id="patch/mamba-selective-scan-onnx",
        why="falcon_mamba's ONNX model fixed the sequence axis to the sample length (input_ids [s, 8], the "
        "loop in mamba_selective_scan unrolled: patch/mamba-selective-scan-hop is dynamo-only) and ORT rejected "
        "the grown input; with the scan op not detached, torch.onnx's type promotion fails with "
        "\"AttributeError: 'SymInt' object has no attribute 'unsqueeze'\" in scan's fake kernel",
        upstream="torch 2.13 torch._higher_order_ops.scan autograd path under fake tensors with symbolic "
        "shapes (scan_fake_tensor_mode stacks saved SymInts), hit by torch.onnx InsertTypePromotion; "
        "transformers 5.24 mamba_selective_scan",
        backends=("onnx",),
        models=_VERIFIED,
        examples=EXAMPLES,
    ),
    target=tuple(f"transformers.models.{f}.modeling_{f}.mamba_selective_scan" for f in _VERIFIED),
    replacement=scan_selective_detached,
)
