"""The routed experts forward of the MoE patches against transformers' own experts forwards, in eager.

`routed_experts_forward` (the form patch/moe-batched-experts traces) must compute
what transformers' `batched_mm` and `grouped_mm` forwards compute, in the edge cases: experts that get no token,
one expert picked twice for a token (tied router scores resolved to the same expert by a custom router),
bf16 experts with fp32 routing weights, and transposed experts with biases (gpt_oss).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers.integrations import moe

from hfexport.rewrites.experts import routed_experts_forward
from hfexport.rewrites.rules._moe_batched import gpt_oss, qwen3_moe


def _experts(built: Any) -> torch.nn.Module:
    model, _ = built
    return next(m for m in model.modules() if hasattr(m, "has_gate") and hasattr(m, "is_transposed"))


def _routing(tokens: int, experts: int, top_k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])
    return index, torch.rand(tokens, top_k, generator=generator)


@pytest.mark.parametrize("build", [lambda: qwen3_moe(3, experts=8), lambda: gpt_oss(3)], ids=["qwen3_moe", "gpt_oss"])
def test_routed_equals_batched_mm_and_grouped_mm(build: Any) -> None:
    experts = _experts(build())
    torch.manual_seed(0)
    hidden = torch.randn(9, experts.gate_up_proj.shape[-1 if not experts.is_transposed else 1])
    index, weights = _routing(9, experts.num_experts, 2, seed=1)
    with torch.no_grad():
        expected = moe.batched_mm_experts_forward(experts, hidden, index, weights)
        grouped = moe.grouped_mm_experts_forward(experts, hidden, index, weights)
        actual = routed_experts_forward(experts, hidden, index, weights)
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(actual, grouped, atol=1e-6, rtol=1e-5)


def test_experts_without_tokens_and_an_expert_picked_twice() -> None:
    experts = _experts(qwen3_moe(3, experts=8))
    hidden = torch.randn(3, experts.gate_up_proj.shape[-1], generator=torch.Generator().manual_seed(2))
    # Experts 1, 2, 4, 6 and 7 get nothing; token 1 has expert 5 in both slots.
    index = torch.tensor([[0, 3], [5, 5], [3, 0]])
    weights = torch.tensor([[0.7, 0.3], [0.5, 0.5], [0.6, 0.4]])
    with torch.no_grad():
        expected = moe.batched_mm_experts_forward(experts, hidden, index, weights)
        actual = routed_experts_forward(experts, hidden, index, weights)
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-5)


def test_bf16_experts_with_fp32_routing_weights() -> None:
    experts = _experts(qwen3_moe(3, experts=8)).to(torch.bfloat16)
    hidden = torch.randn(6, experts.gate_up_proj.shape[-1], generator=torch.Generator().manual_seed(3))
    index, weights = _routing(6, 8, 2, seed=4)
    with torch.no_grad():
        expected = moe.batched_mm_experts_forward(experts, hidden.bfloat16(), index, weights)
        actual = routed_experts_forward(experts, hidden.bfloat16(), index, weights)
    assert actual.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(actual, expected, atol=0.0, rtol=0.0)
