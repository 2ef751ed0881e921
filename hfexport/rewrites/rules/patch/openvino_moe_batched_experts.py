"""Mixture-of-experts for OpenVINO: run transformers' `grouped_mm` experts one expert at a time over the tokens
routed to it, during the trace."""

from __future__ import annotations

from hfexport.rewrites.kinds.patch import MethodPatch
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.patch._moe_batched import EXAMPLES, MODELS, dispatches_experts, routed_experts

openvino_moe_batched_experts = MethodPatch(
    RuleMeta(
        id="patch/openvino-moe-batched-experts",
        why="openvino.convert_model has no conversion rule for aten.histc and aten.empty_permuted, which "
        "transformers' grouped_mm experts forward uses for its expert offsets and inverse permutation; per "
        "expert, over the (token, slot) pairs routed to it (nonzero + index_select + scatter_add), memory and FLOPs"
        " grow with tokens x top_k, not tokens x expert weights: a 512-token prefill at Qwen3-30B-A3B width "
        "(hidden 2048, 128 experts top-8, expert inter 768, bf16) peaks 48 MB above the weights, where "
        "batched_mm's weight gathers took 1161 MB at 16 tokens, ~36 GB at 512 (tools/moe_memory.py)",
        upstream="openvino==2026.4.1 src/frontends/pytorch/src/op_table.cpp no translator for aten.histc / "
        "aten.empty_permuted (transformers integrations/moe.py grouped_mm_experts_forward)",
        backends=("openvino",),
        models=MODELS,
        examples=EXAMPLES,
    ),
    target=dispatches_experts,
    method="forward",
    replacement=routed_experts,
)
