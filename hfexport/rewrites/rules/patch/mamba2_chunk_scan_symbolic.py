"""Mamba-2 chunked scan: one program for every sequence length, not just the sample's chunk count.

transformers' pure-torch `mamba2_chunk_scan` (copied verbatim into mamba2, bamba, falcon_h1, granitemoehybrid,
nemotron_h and zamba2) has no Python loop, but an export from a sample shorter than one chunk is still pinned:

- the chunk reshapes infer their `-1` as a division of the padded length; with one chunk in the sample, the
  views' contiguity checks guard `num_chunks == 1` (torch's 0/1 specialisation of a derived size), so e.g.
  bamba exported from 8 tokens rejects 17, 32 or 35 tokens;
- `if pad_size > 0: output = output[:, :sequence_length]` guards "not a multiple of chunk_size", so the same
  program also rejects 16 tokens.

torch's `backed_size_oblivious` config would lift the first guard, but it is process-global (not thread-local)
and so not something a scoped patch may flip. Instead the replacement keeps upstream's arithmetic and changes
the chunking: it counts chunks explicitly and always pads at least one whole chunk, so the count is >= 2 for
every input (no size-1 guard can be taken) and the final slice always drops padding (no branch). Padded
positions have zero inputs and zero log-decay, so they add exact zeros to the kept outputs and leave the final
state as it was (its decay factor is exp(0) = 1).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hfexport.rewrites.example_models import token_inputs
from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, ModuleFunctionPatch
from hfexport.rewrites.rule import RuleMeta, ScanCause

_FAMILIES = ("mamba2", "bamba", "falcon_h1", "granitemoehybrid", "nemotron_h", "zamba2")


def _segment_sum(x: torch.Tensor) -> torch.Tensor:
    # Upstream's numerically stable segment sum (masked cumsum), so the decays match eager bit for bit.
    size = x.size(-1)
    x = x[..., None].expand(*x.size(), size)
    strictly_lower = torch.tril(torch.ones(size, size, device=x.device, dtype=torch.bool), diagonal=-1)
    x = x.masked_fill(~strictly_lower, 0)
    summed = torch.cumsum(x, dim=-2)
    lower = torch.tril(torch.ones(size, size, device=x.device, dtype=torch.bool), diagonal=0)
    return summed.masked_fill(~lower, -torch.inf)


def symbolic_chunk_scan(
    original: Any,
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    chunk_size: int,
    D: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, float("inf")),
    return_final_states: bool = False,
    **kwargs: Any,
) -> Any:
    batch_size, sequence_length, num_heads, head_dim = hidden_states.shape
    # A static length traces fine as it is; only a symbolic one needs (and pays for) the extra chunk.
    if not isinstance(sequence_length, torch.SymInt):
        return NOT_APPLICABLE
    num_groups = B.shape[2]

    if dt_bias is not None:
        dt = dt + dt_bias.to(dt.dtype)
    if dt_softplus:
        dt = F.softplus(dt)
    dt = torch.clamp(dt, min=dt_limit[0], max=dt_limit[1])
    hidden_states = hidden_states.float()
    B = B.float().repeat_interleave(num_heads // num_groups, dim=2, output_size=num_heads)
    C = C.float().repeat_interleave(num_heads // num_groups, dim=2, output_size=num_heads)

    # Explicit count (no `-1` for torch to infer) plus one whole chunk of padding: see the module docstring.
    num_chunks = (sequence_length + chunk_size - 1) // chunk_size + 1
    pad_size = num_chunks * chunk_size - sequence_length

    def pad(x: torch.Tensor) -> torch.Tensor:  # zero-pad the sequence axis (dim 1) of a 3-D or 4-D tensor
        return F.pad(x, (0, 0) * (x.ndim - 2) + (0, pad_size))

    def into_chunks(x: torch.Tensor) -> torch.Tensor:  # (b, s, ...) -> (b, c, l, ...)
        return pad(x).reshape(x.shape[0], num_chunks, chunk_size, *x.shape[2:])

    D_residual = D[..., None] * pad(hidden_states) if D is not None else None
    hidden_states = hidden_states * dt[..., None].float()
    A = A.to(hidden_states.dtype) * dt.float()
    hidden_states, A, B, C = (into_chunks(x) for x in (hidden_states, A, B, C))

    # From here on upstream's computation, unchanged: b batch, c chunk, l/s position, h head, p head_dim,
    # n state.
    A = A.permute(0, 3, 1, 2)
    A_cumsum = torch.cumsum(A, dim=-1)
    L = torch.exp(_segment_sum(A))
    G = torch.einsum("bclhn,bcshn->bclsh", C, B)
    M = G * L.permute(0, 2, 3, 4, 1)
    Y_diag = torch.einsum("bclsh,bcshp->bclhp", M, hidden_states)
    decay_states = torch.exp(A_cumsum[:, :, :, -1:] - A_cumsum)
    B_decay = B * decay_states.permute(0, -2, -1, 1)[..., None]
    states = torch.einsum("bclhn,bclhp->bchpn", B_decay, hidden_states)
    previous_states = (
        initial_states[:, None].to(dtype=states.dtype, device=states.device)
        if initial_states is not None
        else torch.zeros_like(states[:, :1])
    )
    states = torch.cat([previous_states, states], dim=1)
    decay_chunk = torch.exp(_segment_sum(F.pad(A_cumsum[:, :, :, -1], (1, 0)))).transpose(1, 3)
    new_states = torch.einsum("bzch,bzhpn->bchpn", decay_chunk, states)
    states, final_state = new_states[:, :-1], new_states[:, -1]
    C_times_states = torch.einsum("bclhn,bchpn->bclhp", C, states)
    Y_off = C_times_states * torch.exp(A_cumsum).permute(0, 2, 3, 1)[..., None]
    output = (Y_diag + Y_off).contiguous().reshape(batch_size, num_chunks * chunk_size, num_heads, head_dim)
    if D_residual is not None:
        output = output + D_residual
    # Always slice (pad_size >= 1), then copy: callers `.view()` the result, and asking whether the slice is
    # already contiguous would guard on the padding being zero.
    output = output[:, :sequence_length].clone(memory_format=torch.contiguous_format)
    if return_final_states:
        return output, final_state
    return output


def _bamba(tokens: int) -> tuple[torch.nn.Module, dict[str, Any]]:
    from transformers import BambaConfig, BambaModel

    torch.manual_seed(0)
    config = BambaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        attn_layer_indices=[],
        mamba_n_heads=4,
        mamba_d_head=8,
        mamba_n_groups=1,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        mamba_chunk_size=16,
    )
    return BambaModel(config).eval(), {"input_ids": torch.randint(0, 64, (2, tokens)), "use_cache": False}


def _mamba2(tokens: int) -> tuple[torch.nn.Module, dict[str, Any]]:
    from transformers import Mamba2Config, Mamba2Model

    torch.manual_seed(0)
    # Two groups over four heads exercise the B/C repeat_interleave.
    config = Mamba2Config(
        vocab_size=64,
        hidden_size=16,
        num_heads=4,
        head_dim=8,
        n_groups=2,
        state_size=8,
        expand=2,
        chunk_size=16,
        num_hidden_layers=1,
    )
    return Mamba2Model(config).eval(), {"input_ids": torch.randint(0, 64, (2, tokens)), "use_cache": False}


mamba2_chunk_scan_symbolic = ModuleFunctionPatch(
    RuleMeta(
        id="patch/mamba2-chunk-scan-symbolic",
        why="Mamba-2 hybrids exported from a sample shorter than one chunk only accept lengths that fit one "
        "chunk and are not a multiple of it (bamba from 8 tokens: 'Guard failed: 16 >= ...' on 17/32/35 "
        "tokens, '... % 16 > 0' on 16); on ONNX Runtime, which checks no guards, every length past the chunk "
        "failed ('Expand node ... invalid expand shape': bamba, falcon_h1, granitemoehybrid at 73 tokens)",
        upstream="transformers==5.24.0 models/mamba2/modeling_mamba2.py mamba2_chunk_scan (`if pad_size > 0`, `-1` "
        "chunk reshapes) and its copies; torch 0/1 specialisation of derived sizes (cf. "
        "https://github.com/pytorch/pytorch/issues/151582)",
        # ONNX and OpenVINO keep no guards: without the rule their programs ran other lengths with the sample's
        # chunk count baked in (ONNX Runtime: "Expand ... invalid expand shape" at 35, 73, 138 tokens). Not on
        # ExecuTorch: with the length symbolic, XNNPACK refuses the chunk reshape (two dynamic dimensions).
        backends=("dynamo", "onnx", "openvino"),
        scan=(
            ScanCause(
                "mamba2-chunk-padding",
                "size-modulo",
                "mamba2_chunk_scan",
                "the Mamba-2 chunk padding `(chunk - L % chunk) % chunk`: its `> 0` branch and chunk count are the "
                "sample's",
            ),
        ),
        models=_FAMILIES,
        examples=(
            Match(
                lambda: _bamba(8),
                "bamba from 8 tokens (half a chunk), then 2*16+3 tokens and another batch",
                other_inputs=lambda: token_inputs(3, 2 * 16 + 3),
            ),
            Match(
                lambda: _mamba2(5),
                "mamba2 with grouped B/C from 5 tokens, then exactly two chunks (32 tokens)",
                other_inputs=lambda: token_inputs(2, 32),
            ),
            NoMatch(
                lambda: _bamba(8),
                "bamba exported for 8 tokens only (static)",
                reason="the replacement declines a concrete sequence length: the original's chunks are exact there",
            ),
        ),
    ),
    target=tuple(f"transformers.models.{f}.modeling_{f}.mamba2_chunk_scan" for f in _FAMILIES),
    replacement=symbolic_chunk_scan,
)
