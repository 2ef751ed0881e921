"""`patch/kimi-delta-chunk-scan-hop` against transformers' `chunk_kimi_delta_attention`, as an exported program.

The replacement is exported once with a symbolic length (from 8 tokens, one chunk) and the program is run at
lengths below, at and past the chunk size, with and without an initial state; outputs and final states are
compared with the original function run eagerly. The model-level examples live in the rule (test_examples.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers.models.bailing_hybrid import modeling_bailing_hybrid

from hfexport.rewrites.rules.patch.kimi_delta_chunk_scan_hop import scan_chunk_kimi_delta_attention

ORIGINAL = modeling_bailing_hybrid.chunk_kimi_delta_attention
HEADS, K_DIM, V_DIM = 2, 16, 8


class _Scan(torch.nn.Module):
    def __init__(self, with_state: bool) -> None:
        super().__init__()
        self.with_state = with_state

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        state: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return scan_chunk_kimi_delta_attention(
            ORIGINAL,
            query,
            key,
            value,
            g,
            beta,
            initial_state=state if self.with_state else None,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )


def _inputs(batch: int, tokens: int, dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    query, key = (torch.randn(batch, tokens, HEADS, K_DIM, generator=gen) for _ in range(2))
    value = torch.randn(batch, tokens, HEADS, V_DIM, generator=gen)
    # A log-decay per key channel, inside KDA's safe-gate range [-5, 0) but weak, so the state carries over
    # chunks (a strong decay would hide an error in the inter-chunk recurrence or the initial state).
    g = -0.05 * torch.rand(batch, tokens, HEADS, K_DIM, generator=gen)
    beta = torch.rand(batch, tokens, HEADS, generator=gen)
    state = torch.randn(batch, HEADS, K_DIM, V_DIM, generator=gen)
    return (*(x.to(dtype) for x in (query, key, value, g, beta)), state)


def _export(with_state: bool, dtype: torch.dtype) -> Any:
    # Dim.DYNAMIC, as the library's Dim.AUTO but refusing to specialise: torch cannot prove some always-true
    # size identities of the padded length over an explicit range (it would reject `Dim(max=...)`), so they stay
    # as runtime checks, as in a real export.
    seq = {0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim.DYNAMIC}
    shapes = (seq, seq, seq, seq, seq, {0: torch.export.Dim.DYNAMIC})
    return torch.export.export(_Scan(with_state), _inputs(2, 8, dtype), dynamic_shapes=shapes).module()


@pytest.mark.parametrize("with_state", [False, True], ids=["zero-state", "initial-state"])
@pytest.mark.slow
def test_exported_scan_matches_upstream_past_the_chunk(with_state: bool) -> None:
    program = _export(with_state, torch.float32)
    for batch, tokens in [(1, 8), (3, 64), (1, 73), (3, 138)]:
        args = _inputs(batch, tokens, torch.float32, seed=tokens)
        out, state = program(*args)
        want_out, want_state = ORIGINAL(
            *args[:5],
            initial_state=args[5] if with_state else None,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        assert out.shape == want_out.shape and out.dtype == want_out.dtype
        torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4, msg=f"output, batch {batch}, {tokens} tokens")
        torch.testing.assert_close(state, want_state, rtol=1e-4, atol=1e-4, msg=f"state, batch {batch}, {tokens}")


def test_exported_scan_keeps_bf16_inputs_and_outputs() -> None:
    program = _export(True, torch.bfloat16)
    args = _inputs(2, 73, torch.bfloat16, seed=5)
    out, state = program(*args)
    want_out, want_state = ORIGINAL(
        *args[:5], initial_state=args[5], output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    # Both compute in fp32 and round the output to bf16 once: at most a bf16 ulp or so apart.
    assert out.dtype == torch.bfloat16 and state.dtype == torch.float32
    torch.testing.assert_close(out, want_out, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(state, want_state, rtol=1e-4, atol=1e-4)
