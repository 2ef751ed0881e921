"""Mamba-1 selective scan: the sequential recurrence as a `scan` higher-order op.

transformers' pure-torch `mamba_selective_scan` (copied verbatim into mamba, falcon_mamba, jamba, zamba)
runs `for index in range(seq_len)`: torch.export unrolls the loop and specialises the sequence length to
the sample's, so the program rejects every other length. Its associative-scan path is switched off under
export on purpose. `torch._higher_order_ops.scan` traces the same per-step arithmetic once with a
symbolic length, so results are bit-identical to eager.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, ModuleFunctionPatch
from hfexport.rewrites.rule import RuleMeta

_FAMILIES = ("mamba", "falcon_mamba", "jamba", "zamba")


def scan_selective(
    original: Any,
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    use_mambapy: bool = False,
    use_associative_scan: bool = False,
    **kwargs: Any,
) -> Any:
    if use_mambapy:  # mambapy's pscan has its own (log-depth) structure; leave it alone
        return NOT_APPLICABLE
    from torch._higher_order_ops.scan import scan

    terms = selective_terms(hidden_states, dt, A, B, C, delta_bias, delta_softplus)

    def step(state: torch.Tensor, xs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        a, bu, c = xs
        state = a * state + bu
        out = torch.matmul(state.to(terms.input_dtype), c.unsqueeze(-1))
        return state, out[:, :, 0]

    ssm_state, outputs = scan(
        step, terms.state0(), (terms.discrete_A.movedim(2, 0), terms.deltaB_u.movedim(2, 0), terms.C.movedim(1, 0))
    )
    return finish_selective(outputs.movedim(0, -1), ssm_state, hidden_states, D, z, return_last_state)


@dataclass
class SelectiveTerms:
    """The per-step operands of transformers' `mamba_selective_scan`, computed as it computes them before its loop."""

    discrete_A: torch.Tensor  # [batch, channels, length, state]
    deltaB_u: torch.Tensor  # [batch, channels, length, state]
    C: torch.Tensor  # [batch, length, state]
    input_dtype: torch.dtype

    def state0(self) -> torch.Tensor:
        # Eager starts from zeros in the input dtype and promotes on the first step; a loop carry must have
        # the promoted dtype from the start (the zeros are exact in either).
        dtype = torch.promote_types(torch.promote_types(self.discrete_A.dtype, self.input_dtype), self.deltaB_u.dtype)
        return torch.zeros_like(self.discrete_A[:, :, 0], dtype=dtype)


def selective_terms(
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    delta_bias: torch.Tensor | None,
    delta_softplus: bool,
) -> SelectiveTerms:
    """The operands of the recurrence `state = a_t * state + bu_t; y_t = state @ c_t`, as upstream builds them."""
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    B = B.transpose(1, 2)
    C = C.transpose(1, 2)
    discrete_A = torch.exp(A[None, :, None, :] * dt[:, :, :, None])
    deltaB_u = (dt[:, :, :, None] * B[:, None, :, :].float()) * hidden_states[:, :, :, None].float()
    return SelectiveTerms(discrete_A, deltaB_u, C, hidden_states.dtype)


def finish_selective(
    scan_output: torch.Tensor,
    ssm_state: torch.Tensor,
    hidden_states: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    return_last_state: bool,
) -> Any:
    """Upstream's epilogue after the loop: the skip term, the gate, and the optional last state."""
    if D is not None:
        scan_output = scan_output + hidden_states * D[None, :, None]
    if z is not None:
        scan_output = scan_output * F.silu(z)
    if return_last_state:
        return scan_output, ssm_state
    return scan_output


def _falcon_mamba(seq_len: int, use_mambapy: bool = False) -> tuple[torch.nn.Module, dict[str, Any]]:
    from transformers import FalconMambaConfig, FalconMambaModel

    torch.manual_seed(0)
    config = FalconMambaConfig(
        vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=1, expand=2, use_falcon_mambapy=use_mambapy
    )
    model = FalconMambaModel(config).eval()
    ids = torch.randint(0, 64, (2, seq_len))
    return model, {"input_ids": ids, "use_cache": False}


# Shared with the ONNX variant of this rule (patches/onnx_ssm_scan.py): same model, same proof.
EXAMPLES = (
    Match(
        lambda: _falcon_mamba(7),
        "falcon_mamba, odd length, then a longer input through the same program",
        atol=1e-6,
        rtol=1e-6,
        other_inputs=lambda: {"input_ids": torch.randint(0, 64, (3, 12)), "use_cache": False},
    ),
    Match(lambda: _falcon_mamba(1), "a single token", atol=1e-6, rtol=1e-6),
    NoMatch(
        lambda: _falcon_mamba(7, use_mambapy=True),
        "falcon_mamba with use_mambapy=True",
        reason="the replacement leaves mambapy's own scan (config.use_mambapy) to the original",
    ),
)

mamba_selective_scan_hop = ModuleFunctionPatch(
    RuleMeta(
        id="patch/mamba-selective-scan-hop",
        why="Mamba-1 models export with the sequence length baked in (`for index in range(seq_len)` in "
        "mamba_selective_scan); a scan op keeps the length symbolic with identical numerics",
        upstream="transformers==5.24.0 models/mamba/modeling_mamba.py mamba_selective_scan (a Python loop over the "
        "sequence: the associative scan is disabled under export); torch._higher_order_ops.scan keeps the length "
        "symbolic",
        backends=("dynamo",),
        models=_FAMILIES,
        examples=EXAMPLES,
    ),
    target=tuple(f"transformers.models.{f}.modeling_{f}.mamba_selective_scan" for f in _FAMILIES),
    replacement=scan_selective,
)
