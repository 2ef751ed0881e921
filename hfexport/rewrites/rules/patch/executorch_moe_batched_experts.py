"""Mixture-of-experts for ExecuTorch: run transformers' `grouped_mm` experts one expert at a time over the tokens
routed to it, during the trace."""

from __future__ import annotations

import dataclasses

from hfexport.rewrites.kinds.patch import MethodPatch
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.patch._moe_batched import EXAMPLES, MODELS, dispatches_experts, routed_experts

executorch_moe_batched_experts = MethodPatch(
    RuleMeta(
        id="patch/executorch-moe-batched-experts",
        why="transformers' grouped_mm experts forward computes expert offsets with aten.histc, which to_edge "
        "refuses (not in the core ATen opset), and in bf16 keeps aten._grouped_mm, which has no XNNPACK or "
        "portable kernel; per expert, over the (token, slot) pairs routed to it (nonzero over the flat routing + "
        "index_select + scatter_add), memory and FLOPs grow with tokens x top_k, where transformers' batched_mm "
        "form (used here until session 14) gathers each pair's expert weights (~26 GB per projection for a "
        "512-token Qwen3-30B-A3B prefill, tools/bench_moe.py). The pairs come from nonzero over the flat [tokens *"
        " top_k] routing: nonzero over the 2-D routing gives a column-major [pairs, 2] result whose column slice "
        "failed at run time (slice_copy.Tensor_out: 'tensors have different dim orders', error 0x12). The gate/up "
        "split of a routed expert's rows has a data-dependent length, which to_edge's argument validator cannot "
        "take: executorch/split-as-slices is required. Each expert's weight slice and transpose are still copied "
        "into planned buffers on every call (576 MB planned for 16 experts at hidden 2048, against 2306 MB for "
        "batched_mm's gathers at 16 tokens; docs/benchmarks.md, 'MoE prefill at scale')",
        upstream="executorch==1.4.1 exir/verification/verifier.py core ATen check refuses aten.histc; no "
        "_grouped_mm.out kernel in kernels/portable; transformers integrations/moe.py grouped_mm_experts_forward",
        backends=("executorch",),
        requires=("executorch/split-as-slices",),
        models=MODELS,
        examples=(*EXAMPLES[:3], dataclasses.replace(EXAMPLES[3], slow=True)),  # the NoMatch: 22 s on 2 cores
    ),
    target=dispatches_experts,
    method="forward",
    replacement=routed_experts,
)
