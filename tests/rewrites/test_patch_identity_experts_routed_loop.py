"""`patch/identity-experts-routed-loop` against LongCat-Flash's own experts forward, in eager: bit-identical.

Edge cases: routed experts without tokens, tokens routed to two identity experts (summed in expert-index order
whichever slot holds the smaller index), tokens routed only to routed experts, bf16 hidden states with fp32
routing weights, an empty batch of tokens, and experts without routed weights (n_routed_experts=0).
"""

from __future__ import annotations

import pytest
import torch

from hfexport.rewrites.rules._moe_batched import qwen3_moe
from hfexport.rewrites.rules.patch.identity_experts_routed_loop import (
    _longcat,
    has_identity_experts,
    identity_experts_forward,
)


def _experts(zero_experts: int = 3, routed: int = 4) -> torch.nn.Module:
    model, _ = _longcat(3, zero_experts=zero_experts, routed=routed)
    return next(m for m in model.modules() if type(m).__name__ == "LongcatFlashExperts")


def _run(experts: torch.nn.Module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> None:
    with torch.no_grad():
        expected = type(experts).forward(experts, hidden, index, weights)
        actual = identity_experts_forward(None, experts, hidden, index, weights)
    assert actual.dtype == expected.dtype == hidden.dtype and actual.shape == expected.shape
    assert torch.equal(actual, expected), (actual - expected).abs().max()


def test_predicate_matches_longcat_only() -> None:
    assert has_identity_experts(_experts())
    assert has_identity_experts(_experts(zero_experts=0))
    qwen, _ = qwen3_moe(3)
    assert not any(has_identity_experts(m) for m in qwen.modules())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_routing_is_bit_identical(seed: int) -> None:
    experts = _experts(zero_experts=5)
    generator = torch.Generator().manual_seed(seed)
    tokens = 13
    hidden = torch.randn(tokens, 16, generator=generator)
    index = torch.stack([torch.randperm(9, generator=generator)[:2] for _ in range(tokens)])
    _run(experts, hidden, index, torch.rand(tokens, 2, generator=generator) * 6)


def test_identity_pairs_in_either_slot_order_and_unused_experts() -> None:
    experts = _experts(zero_experts=3)
    hidden = torch.randn(5, 16, generator=torch.Generator().manual_seed(3)) * 1e3
    # Experts 1 and 2 get nothing; tokens 0 and 1 have two identity experts, in both slot orders; token 2 only
    # routed experts; token 3 a routed and an identity expert; token 4 the last identity expert.
    index = torch.tensor([[6, 4], [4, 6], [0, 3], [5, 0], [6, 3]])
    weights = torch.tensor([[0.7, 0.3], [0.3, 0.7], [0.6, 0.4], [1e-3, 5.0], [0.1, 0.9]])
    _run(experts, hidden, index, weights)


def test_bf16_hidden_states_with_fp32_weights() -> None:
    experts = _experts(zero_experts=3).to(torch.bfloat16)
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(11, 16, generator=generator).bfloat16()
    index = torch.stack([torch.randperm(7, generator=generator)[:2] for _ in range(11)])
    _run(experts, hidden, index, torch.rand(11, 2, generator=generator))


def test_no_routed_experts_and_no_tokens() -> None:
    experts = _experts(zero_experts=4, routed=0)
    assert has_identity_experts(experts)
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(6, 16, generator=generator)
    index = torch.stack([torch.randperm(4, generator=generator)[:2] for _ in range(6)])
    _run(experts, hidden, index, torch.rand(6, 2, generator=generator))
    _run(_experts(), hidden[:0], index[:0], torch.rand(0, 2))
