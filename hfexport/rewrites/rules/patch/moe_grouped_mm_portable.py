"""Mixture-of-experts: keep exported MoE graphs free of transformers-only custom ops."""

from __future__ import annotations

from typing import Any

import torch

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, ModuleFunctionPatch
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.patch._moe_batched import qwen3_moe


def _uses_stacked_experts(model: torch.nn.Module) -> bool:
    # transformers' fused experts modules keep all experts in one 3-D `down_proj` parameter.
    return any(
        isinstance(getattr(m, "down_proj", None), torch.nn.Parameter) and m.down_proj.ndim == 3 for m in model.modules()
    )


def gathered_grouped_mm(original: Any, input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> Any:
    from transformers.integrations import moe

    # Where transformers can call torch's own grouped_mm (e.g. bf16 weights), that aten op is exported as is.
    if moe._can_use_grouped_mm(input, weight, offs):
        return NOT_APPLICABLE
    x = input.to(weight.dtype)
    rows = torch.arange(x.shape[0], device=x.device)
    # Row r belongs to the group i with offs[i-1] <= r < offs[i] (offs holds cumulative group ends), i.e.
    # the number of ends at or before r; rows past the last end are left zero, like the fallback op does.
    group = (rows[:, None] >= offs[None, :]).sum(-1)
    inside = group < weight.shape[0]
    per_row_weight = weight[group.clamp(max=weight.shape[0] - 1)]
    out = torch.bmm(x.unsqueeze(1), per_row_weight).squeeze(1)
    return torch.where(inside[:, None], out, torch.zeros((), dtype=out.dtype, device=out.device))


def _moe_model(
    tokens: int, experts: int = 4, implementation: str | None = None
) -> tuple[torch.nn.Module, dict[str, Any]]:
    # The tiny Qwen3-MoE the batched-experts patches use, without a cache (the experts are the point).
    model, inputs = qwen3_moe(tokens, experts, implementation)
    return model, {**inputs, "use_cache": False}


moe_grouped_mm_portable = ModuleFunctionPatch(
    RuleMeta(
        id="patch/moe-grouped-mm-portable",
        why="fp32 MoE experts export as the opaque `transformers::grouped_mm_fallback` custom op (a Python "
        "loop over offs.tolist()), which no runtime but transformers' can run; a gathered bmm keeps plain "
        "ATen ops. ONNX only: an ExportedProgram runs transformers' op itself and keeps grouped_mm as the seed "
        "documents, and on ExecuTorch and OpenVINO patch/executorch-moe-batched-experts and "
        "patch/openvino-moe-batched-experts run these experts as batched_mm, which never calls _grouped_mm (this "
        "rule alone leaves the grouped_mm forward's aten.histc there, which neither backend converts)",
        upstream="transformers==5.24.0 integrations/moe.py _can_use_grouped_mm (grouped_mm refused under tracing for "
        "non-bf16 weights; cf. https://github.com/pytorch/pytorch/issues/172440)",
        backends=("onnx",),
        models=("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "olmoe", "granitemoehybrid"),
        examples=(
            Match(
                lambda: _moe_model(7),
                "odd token count, 4 experts, then another batch and length",
                other_inputs=lambda: {"input_ids": torch.randint(0, 64, (3, 4)), "use_cache": False},
            ),
            Match(lambda: _moe_model(1, experts=8), "a single token: most experts get no rows"),
            NoMatch(
                lambda: _moe_model(5, implementation="batched_mm"),
                "qwen3_moe with batched_mm experts",
                reason="the gate is installed (stacked experts) but batched_mm experts never call _grouped_mm",
            ),
        ),
    ),
    target="transformers.integrations.moe._grouped_mm",
    replacement=gathered_grouped_mm,
    applies=_uses_stacked_experts,
)
