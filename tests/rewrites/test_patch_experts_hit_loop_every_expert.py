"""patch/experts-hit-loop-every-expert: the rewrite turns a loop over `nonzero()` of the experts hit into a loop over
every expert (dropping the per-row index conversion and the empty-rows skip) and leaves a hit tensor used elsewhere;
the predicate takes DBRX's experts, not an experts class with transformers' dispatch; the rewritten forward equals
upstream's bit for bit when most experts get no token, and exports with a symbolic length where upstream's loop does
not. The rule's examples (tests/rewrites/test_examples.py) compare whole models with eager on Dynamo and ONNX."""

from __future__ import annotations

import textwrap

import pytest
import torch

from hfexport.rewrites.rules.patch.experts_hit_loop_every_expert import (
    _FORWARD,
    loops_over_experts_hit,
    rewrite_source,
)

modeling = pytest.importorskip("transformers.models.dbrx.modeling_dbrx")

_LOOP = """
def forward(self, hidden, top_k_index):
    mask = one_hot(top_k_index, num_classes=self.num_experts + 1).permute(2, 1, 0)
    expert_hit = mask.sum(dim=(-1, -2)).nonzero()
    for expert_idx in expert_hit:
        expert = int(expert_idx.item())
        rows = torch.where(mask[expert])[0]
        if rows.numel() == 0:
            continue
        hidden = hidden + rows.sum()
    return hidden
"""


def test_the_loop_runs_over_every_expert() -> None:
    rewritten = rewrite_source(textwrap.dedent(_LOOP))
    assert rewritten is not None
    assert "for expert in range(self.num_experts):" in rewritten
    assert "expert_hit = None" in rewritten
    assert "numel()" not in rewritten and "expert_idx" not in rewritten
    assert "rows = torch.where(mask[expert])[0]" in rewritten  # the body is upstream's


def test_a_hit_tensor_used_outside_the_loop_is_left() -> None:
    used = _LOOP.replace("    return hidden", "    return hidden, len(expert_hit)")
    assert rewrite_source(textwrap.dedent(used)) is None
    assert rewrite_source("def forward(self, x):\n    return x\n") is None


def _experts(experts: int) -> torch.nn.Module:
    from transformers import DbrxConfig

    config = DbrxConfig(
        d_model=16, n_heads=2, n_layers=1, ffn_config={"ffn_hidden_size": 8, "moe_num_experts": experts, "moe_top_k": 2}
    )
    torch.manual_seed(0)
    module = modeling.DbrxExperts(config.ffn_config)  # as DbrxFFN builds it
    for parameter in module.parameters():
        torch.nn.init.normal_(parameter)
    return module.eval()


def _inputs(tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(tokens)
    hidden = torch.randn(2, tokens, 16, generator=generator)
    # Top-2 of the first 3 experts only: the others get no token.
    top_k_index = torch.stack([torch.randperm(3, generator=generator)[:2] for _ in range(2 * tokens)])
    return hidden, top_k_index, torch.rand(2 * tokens, 2, generator=generator)


def test_the_predicate_takes_dbrx_experts_only() -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    assert loops_over_experts_hit(_experts(8))
    config = Qwen3MoeConfig(hidden_size=16, moe_intermediate_size=8, num_experts=4, num_experts_per_tok=2)
    assert not loops_over_experts_hit(Qwen3MoeExperts(config))  # transformers' dispatch runs it under export
    assert not loops_over_experts_hit(torch.nn.Linear(2, 2))


class _Rewritten(torch.nn.Module):
    def __init__(self, experts: torch.nn.Module) -> None:
        super().__init__()
        self.experts = experts

    def forward(self, hidden, top_k_index, top_k_weights):
        return _FORWARD.replacement(None, self.experts, hidden, top_k_index, top_k_weights)


def test_every_expert_gives_upstreams_sums_and_exports_with_a_symbolic_length() -> None:
    experts = _experts(8)
    with torch.no_grad():
        for tokens in (3, 7):
            inputs = _inputs(tokens)
            assert torch.equal(_Rewritten(experts)(*inputs), experts(*inputs))
        tokens = torch.export.Dim("tokens", min=2, max=64)
        rows = torch.export.Dim("rows", min=4, max=128)
        shapes = ({1: tokens}, {0: rows}, {0: rows})
        with pytest.raises(Exception, match="data-dependent"):
            torch.export.export(experts, _inputs(3), dynamic_shapes=shapes)
        program = torch.export.export(_Rewritten(experts), _inputs(3), dynamic_shapes=shapes)
        inputs = _inputs(5)
        torch.testing.assert_close(program.module()(*inputs), experts(*inputs))
