"""JetMoe's parallel experts for ExecuTorch: one gathered weight per row instead of a split by expert counts."""

from __future__ import annotations

from typing import Any

import torch

from hfexport.rewrites.example_models import dense_decoder, tiny_model
from hfexport.rewrites.examples import Built, Match, NoMatch
from hfexport.rewrites.kinds.patch import MethodPatch
from hfexport.rewrites.rule import RuleMeta


def rowwise_experts(original: Any, module: torch.nn.Module, inputs: torch.Tensor, expert_size: Any) -> torch.Tensor:
    """`JetMoeParallelExperts.forward` without the split: row j of `inputs` (rows grouped by expert, in expert
    order, `expert_size[e]` rows for expert e) times the transposed weight of its own expert.

    The expert of row j is the number of group ends at or before j (`sum(expert_size[:e + 1]) <= j`), so no
    shape depends on the counts: the same products as `F.linear(group_e, weight[e])` per group, and the
    rows come out in the same order as the original's `cat`.
    """
    rows = torch.arange(inputs.shape[0], device=inputs.device)
    expert_of_row = torch.zeros_like(rows)
    end = 0
    for size in expert_size[:-1]:  # sizes stay symbolic: compared as scalars, never made a tensor's shape
        end = end + size
        expert_of_row = expert_of_row + (rows >= end).long()
    weights = module.weight[expert_of_row]  # [rows, out, in]
    return torch.bmm(weights, inputs.unsqueeze(-1)).squeeze(-1)


# What JetMoe needs on ExecuTorch besides this rule: the attention output's view after SDPA (refused by the edge
# lowering), and the router's split and integer sort (no kernels that load: "Failed to load method forward").
_NEEDS = (
    "executorch/sdpa-output-contiguous-before-view",
    "executorch/split-as-slices",
    "executorch/integer-sort-as-topk",
)


def _jetmoe(tokens: int, experts: int = 4, top_k: int = 2) -> Built:
    return tiny_model(
        "JetMoeConfig",
        "JetMoeModel",
        tokens=tokens,
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=1,
        num_key_value_heads=2,
        kv_channels=8,
        intermediate_size=16,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
    )


jetmoe_rowwise_experts = MethodPatch(
    RuleMeta(
        id="patch/jetmoe-rowwise-experts",
        why="JetMoe's parallel experts split the expert-sorted rows by their counts (`expert_size.tolist()`, "
        "data-dependent sizes); to_edge's argument validator takes len() of the first piece of the split and "
        "fails on its unbacked size ('Could not extract specialized integer from data-dependent expression'). "
        "Each row instead multiplies its own expert's weight (a gather and a bmm): the same products, every "
        "shape static or backed",
        upstream="executorch==1.4.1 exir/verification/arg_validator.py EdgeOpArgValidator.call_function reads a "
        "Tensor[] return's first piece as the list (len() of a tensor); transformers 5.24 "
        "models/jetmoe/modeling_jetmoe.py JetMoeParallelExperts.forward",
        backends=("executorch",),
        aliases=("patch/executorch-jetmoe-rowwise-experts",),
        models=("jetmoe",),
        examples=(
            Match(
                lambda: _jetmoe(6),
                "JetMoe (MoA attention experts and MoE MLP experts, top-2 of 4), then another batch and length",
                other_inputs=lambda: _jetmoe(11)[1],
                needs=_NEEDS,
            ),
            Match(
                lambda: _jetmoe(3, experts=8, top_k=1),
                "top-1 of 8 experts over 6 rows: most experts empty",
                needs=_NEEDS,
            ),
            NoMatch(
                dense_decoder,
                "a model without JetMoe experts",
                reason="the replacement declines no call, and every JetMoe layer (attention and MLP) runs parallel "
                "experts, so no JetMoe model goes without it: only another architecture, where it is not installed",
                applies=False,
                slow=True,  # 16 s on the 2-core CI machine
            ),
        ),
    ),
    target="transformers.models.jetmoe.modeling_jetmoe.JetMoeParallelExperts.forward",
    replacement=rowwise_experts,
)
