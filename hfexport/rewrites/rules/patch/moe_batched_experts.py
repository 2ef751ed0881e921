"""Mixture-of-experts for ExecuTorch and OpenVINO: run transformers' `grouped_mm` experts one expert at a time over
the tokens routed to it, during the trace (the body, shared with other rules, is `_moe_batched.routed_experts`)."""

from __future__ import annotations

from hfexport.rewrites.kinds.patch import MethodPatch
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules._moe_batched import EXAMPLES, MODELS, dispatches_experts, routed_experts

moe_batched_experts = MethodPatch(
    RuleMeta(
        id="patch/moe-batched-experts",
        why="transformers' grouped_mm experts forward computes expert offsets with aten.histc and an inverse "
        "permutation with aten.empty_permuted: to_edge refuses histc (not in the core ATen opset), and in bf16 "
        "keeps aten._grouped_mm, which has no XNNPACK or portable kernel; openvino.convert_model has no conversion "
        "rule for either. Per expert, over the (token, slot) pairs routed to it (nonzero over the flat [tokens * "
        "top_k] routing + index_select + scatter_add), memory and FLOPs grow with tokens x top_k, where transformers' "
        "batched_mm form gathers each pair's expert weights (~26 GB per projection for a 512-token Qwen3-30B-A3B "
        "prefill, tools/bench_moe.py; on OpenVINO at that width a 512-token prefill peaks 48 MB above the weights, "
        "where batched_mm took 1161 MB at 16 tokens, tools/moe_memory.py). ExecuTorch: nonzero over the 2-D routing "
        "gave a column-major [pairs, 2] result whose column slice failed at run time (slice_copy.Tensor_out: "
        "'tensors have different dim orders', error 0x12); the gate/up split of a routed expert's rows has a "
        "data-dependent length, which to_edge's argument validator cannot take: executorch/split-as-slices is "
        "required. Each expert's weight slice and transpose are still copied into planned buffers on every call "
        "(576 MB planned for 16 experts at hidden 2048, against 2306 MB for batched_mm's gathers at 16 tokens; "
        "docs/benchmarks.md, 'MoE prefill at scale')",
        upstream="executorch==1.4.1 exir/verification/verifier.py core ATen check refuses aten.histc; no "
        "_grouped_mm.out kernel in kernels/portable; openvino 2026.4.1 src/frontends/pytorch/src/op_table.cpp has no "
        "translator for aten.histc / aten.empty_permuted; transformers integrations/moe.py grouped_mm_experts_forward",
        # OpenVINO first: its examples are the default tier's (ExecuTorch's lowering of them is slower).
        backends=("openvino", "executorch"),
        requires=("executorch/split-as-slices",),
        models=MODELS,
        aliases=("patch/executorch-moe-batched-experts", "patch/openvino-moe-batched-experts"),
        examples=EXAMPLES,
    ),
    target=dispatches_experts,
    method="forward",
    replacement=routed_experts,
)
