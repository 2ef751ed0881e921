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


def dense_experts(
    original: Any,
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    router_mask: torch.Tensor,
    router_probs: torch.Tensor,
) -> Any:
    """`NllbMoeExperts.forward` over every expert, each weighted by the routing the original would apply.

    The original iterates `for expert_idx in expert_mask.sum(...).nonzero()` and gathers the routed rows with
    `torch.where`: a loop whose length is data, which torch.export cannot trace. Here each expert runs on all
    tokens; a token gets its output times the sum of the `router_probs[token, idx]` over the `(idx, token)`
    pairs the original routes to that expert (the same `one_hot(router_mask)` selection), and tokens the
    expert does not get are left untouched. Experts are added in the original's (ascending) order.
    """
    if self.training:
        return NOT_APPLICABLE  # token dropout is random there
    final_hidden_states = torch.zeros_like(hidden_states)
    # [num_experts (the class), num_experts (idx), tokens], as the original.
    expert_mask = torch.nn.functional.one_hot(router_mask, num_classes=self.num_experts).permute(2, 1, 0)
    for expert_idx in range(self.num_experts):
        selected = expert_mask[expert_idx].transpose(0, 1)  # [tokens, idx]
        weight = (router_probs * selected.to(router_probs.dtype)).sum(-1, keepdim=True)
        current_hidden_states = self[f"expert_{expert_idx}"](hidden_states) * weight
        if self.moe_token_dropout > 0:
            current_hidden_states = current_hidden_states * (1 - self.moe_token_dropout)
        routed = selected.any(-1, keepdim=True)
        final_hidden_states = final_hidden_states + torch.where(
            routed, current_hidden_states.to(hidden_states.dtype), torch.zeros_like(final_hidden_states)
        )
    return final_hidden_states


def _config(**overrides: Any) -> Any:
    from transformers import NllbMoeConfig

    config = dict(d_model=16, num_experts=4, expert_capacity=100, moe_token_dropout=0.2)
    config.update(overrides)
    return NllbMoeConfig(**config)


def _router_inputs(tokens: int, seed: int = 0) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    padding = torch.zeros(tokens, dtype=torch.long)
    padding[:2] = 1  # two padded tokens (NLLB-MoE's padding mask is 1 at padding)
    return {"hidden_states": torch.randn(tokens, 16, generator=generator), "padding_mask": padding}


def _router() -> Any:
    from transformers.models.nllb_moe.modeling_nllb_moe import NllbMoeTop2Router

    torch.manual_seed(0)
    return NllbMoeTop2Router(_config(router_ignore_padding_tokens=False)).eval(), _router_inputs(7)


def _expert_inputs(tokens: int, capacity_drop: bool = False, seed: int = 0) -> dict[str, Any]:
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


def _experts(dropout: float, capacity_drop: bool = False) -> Any:
    torch.manual_seed(0)
    return _Experts(dropout).eval(), _expert_inputs(7, capacity_drop)


def _dense_ffn() -> Any:
    """NLLB-MoE's dense feed-forward layer (the non-sparse layers'): neither a router nor experts."""
    from transformers.models.nllb_moe.modeling_nllb_moe import NllbMoeDenseActDense

    torch.manual_seed(0)
    return NllbMoeDenseActDense(_config(), ffn_dim=32).eval(), {"hidden_states": torch.randn(2, 7, 16)}
