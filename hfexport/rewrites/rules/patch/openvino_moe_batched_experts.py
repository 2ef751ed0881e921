"""Mixture-of-experts for OpenVINO: run transformers' `grouped_mm` experts as `batched_mm` during the trace."""

from __future__ import annotations

from hfexport.rewrites.kinds.patch import MethodPatch
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.patch._moe_batched import EXAMPLES, MODELS, batched_mm_experts, dispatches_experts

openvino_moe_batched_experts = MethodPatch(
    RuleMeta(
        id="patch/openvino-moe-batched-experts",
        why="openvino.convert_model has no conversion rule for aten.histc and aten.empty_permuted, which "
        "transformers' grouped_mm experts forward uses for its expert offsets and inverse permutation; the "
        "batched_mm forward computes the same per-token expert products with gathers and bmm",
        upstream="openvino==2026.4.1 src/frontends/pytorch/src/op_table.cpp no translator for aten.histc / "
        "aten.empty_permuted (transformers integrations/moe.py grouped_mm_experts_forward)",
        backends=("openvino",),
        models=MODELS,
        examples=EXAMPLES,
    ),
    target=dispatches_experts,
    method="forward",
    replacement=batched_mm_experts,
)
