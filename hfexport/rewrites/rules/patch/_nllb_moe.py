"""NLLB-MoE: its router casts its classifier module in forward, and its experts loop over the experts hit."""

from __future__ import annotations

from typing import Any

import torch

from hfexport.rewrites.kinds.patch import NOT_APPLICABLE


def cast_classifier(original: Any, self: torch.nn.Module) -> Any:
    """Skip `self.classifier = self.classifier.to(self.dtype)` when the classifier already has that dtype.

    `Module.to` swaps the parameters, which fails on the fake parameters torch.export traces with
    ("_apply(): Couldn't swap Linear.weight"); with the dtype already right the cast changes nothing.
    """
    params = list(self.classifier.parameters())
    if hasattr(self.classifier, "SCB") or hasattr(self.classifier, "CB") or not params:
        return NOT_APPLICABLE
    if any(p.dtype != self.dtype for p in params):
        return NOT_APPLICABLE  # a real cast: the original runs
    return None


def routed_experts(
    original: Any,
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    router_mask: torch.Tensor,
    router_probs: torch.Tensor,
) -> Any:
    """`NllbMoeExperts.forward` with a loop over every expert, each run on the tokens routed to it.

    The original iterates `for expert_idx in expert_mask.sum(...).nonzero()` and gathers the routed rows with
    `torch.where`: a loop whose length is data, which torch.export cannot trace. Here the loop runs over all
    experts (bounded by their count, unrolled by the trace); each picks its tokens with `nonzero` over a 1-D
    mask (the `(idx, token)` pairs of the original's `one_hot(router_mask)` selection, any per token), runs on
    those rows only and adds them back with `scatter_add`, so memory and FLOPs grow with tokens x the experts a
    token is routed to, not tokens x experts. A token's output is weighted by the sum of `router_probs[token,
    idx]` over its pairs (the original adds one product per pair: the same sum, another rounding). Experts are
    added in the original's ascending order; an expert without tokens runs on 0 rows.
    """
    if self.training:
        return NOT_APPLICABLE  # token dropout is random there
    final_hidden_states = torch.zeros_like(hidden_states)
    for expert_idx in range(self.num_experts):
        # expert_mask[expert_idx] of the original, transposed: [tokens, idx], true where router_mask == expert_idx.
        selected = router_mask == expert_idx
        token = torch.nonzero(selected.any(-1)).reshape(-1)
        weight = (router_probs * selected.to(router_probs.dtype)).sum(-1, keepdim=True).index_select(0, token)
        current_hidden_states = self[f"expert_{expert_idx}"](hidden_states.index_select(0, token)) * weight
        if self.moe_token_dropout > 0:
            current_hidden_states = current_hidden_states * (1 - self.moe_token_dropout)
        current_hidden_states = current_hidden_states.to(hidden_states.dtype)
        # scatter_add, not index_add: OpenVINO's converter refuses aten.index_add without its alpha argument.
        index = token.unsqueeze(-1).expand_as(current_hidden_states)
        final_hidden_states = final_hidden_states.scatter_add(0, index, current_hidden_states)
    return final_hidden_states


def _config(**overrides: Any) -> Any:
    from transformers import NllbMoeConfig

    config = dict(d_model=16, num_experts=4, expert_capacity=100, moe_token_dropout=0.2)
    config.update(overrides)
    return NllbMoeConfig(**config)


def router_inputs(tokens: int, seed: int = 0) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    padding = torch.zeros(tokens, dtype=torch.long)
    padding[:2] = 1  # two padded tokens (NLLB-MoE's padding mask is 1 at padding)
    return {"hidden_states": torch.randn(tokens, 16, generator=generator), "padding_mask": padding}


def router_example() -> Any:
    from transformers.models.nllb_moe.modeling_nllb_moe import NllbMoeTop2Router

    torch.manual_seed(0)
    return NllbMoeTop2Router(_config(router_ignore_padding_tokens=False)).eval(), router_inputs(7)


def expert_inputs(tokens: int, capacity_drop: bool = False, seed: int = 0) -> dict[str, Any]:
    """What NllbMoeSparseMLP hands its experts: the router's top-1 mask and combine weights."""
    from transformers.models.nllb_moe.modeling_nllb_moe import NllbMoeTop2Router

    torch.manual_seed(seed)
    router = NllbMoeTop2Router(_config(expert_capacity=2 if capacity_drop else 100)).eval()
    hidden = torch.randn(tokens, 16)
    with torch.no_grad():
        top_1_mask, router_probs, _ = router(hidden)
    return {"hidden_states": hidden, "router_mask": top_1_mask, "router_probs": router_probs}


class _Experts(torch.nn.Module):
    """NllbMoeExperts under a parent, as in the model (the export keeps the parent's signature)."""

    def __init__(self, dropout: float) -> None:
        super().__init__()
        from transformers.models.nllb_moe.modeling_nllb_moe import NllbMoeExperts

        self.experts = NllbMoeExperts(_config(moe_token_dropout=dropout), ffn_dim=32)

    def forward(self, hidden_states: torch.Tensor, router_mask: torch.Tensor, router_probs: torch.Tensor) -> Any:
        return self.experts(hidden_states, router_mask, router_probs)


def experts_example(dropout: float, capacity_drop: bool = False) -> Any:
    torch.manual_seed(0)
    return _Experts(dropout).eval(), expert_inputs(7, capacity_drop)


def dense_ffn() -> Any:
    """NLLB-MoE's dense feed-forward layer (the non-sparse layers'): neither a router nor experts."""
    from transformers.models.nllb_moe.modeling_nllb_moe import NllbMoeDenseActDense

    torch.manual_seed(0)
    return NllbMoeDenseActDense(_config(), ffn_dim=32).eval(), {"hidden_states": torch.randn(2, 7, 16)}
