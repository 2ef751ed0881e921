"""Mixture-of-experts for ExecuTorch: run transformers' `grouped_mm` experts as `batched_mm` during the trace."""

from __future__ import annotations

from hfexport.rewrites.kinds.patch import MethodPatch
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.patch._moe_batched import EXAMPLES, MODELS, batched_mm_experts, dispatches_experts

executorch_moe_batched_experts = MethodPatch(
    RuleMeta(
        id="patch/executorch-moe-batched-experts",
        why="transformers' grouped_mm experts forward computes expert offsets with aten.histc, which to_edge "
        "refuses (not in the core ATen opset), and in bf16 keeps aten._grouped_mm, which has no XNNPACK or "
        "portable kernel; the batched_mm forward computes the same per-token expert products with gathers and bmm",
        upstream="executorch==1.4.1 exir/verification/verifier.py core ATen check refuses aten.histc; no "
        "_grouped_mm.out kernel in kernels/portable; transformers integrations/moe.py grouped_mm_experts_forward",
        backends=("executorch",),
        models=MODELS,
        examples=EXAMPLES,
    ),
    target=dispatches_experts,
    method="forward",
    replacement=batched_mm_experts,
)
