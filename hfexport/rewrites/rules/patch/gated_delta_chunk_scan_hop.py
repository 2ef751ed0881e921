"""Gated delta rule (Qwen3-Next linear attention): the chunk loop as a `scan` higher-order op.

transformers' pure-torch `torch_chunk_gated_delta_rule` (copied verbatim into qwen3_next, qwen3_5, qwen3_5_moe,
olmo_hybrid, lara_mini and qwen4_exp) runs `for i in range(num_chunks)` over 64-token chunks, so torch.export
unrolls it and the program keeps the sample's chunk count: exported from 8 tokens it rejects anything over 64.
Three more things pin the count even without the loop:

- the chunk reshapes infer their `-1` as a division of the padded length, and the resulting views' contiguity
  checks guard `num_chunks == 1` when the sample fits one chunk (torch's 0/1 specialisation of a derived size);
- the export-only forward substitution writes rows in place (`ut_system[..., i, :i] = ...`), which still
  guards `num_chunks != 1` even under torch's global `backed_size_oblivious` flag;
- the final `[:, :, :sequence_length]` slice is contiguous only when there is no padding, which guards
  "sequence length is (not) a multiple of 64".

The replacement keeps upstream's arithmetic but: counts chunks explicitly and always pads at least one whole
chunk (the count is then >= 2 for every input, so no size-1 guard can be taken, and the slice always drops
padding); inverts the unit-lower-triangular UT system loop-free, as (I - N)^-1 = prod_k (I + N^(2^k)) for the
nilpotent strictly-lower N (2·log2(chunk) matmuls, exact in exact arithmetic); and scans over chunks with
`torch._higher_order_ops.scan`. The padded chunk has zero keys, values, beta and log-decay, so it adds exact
zeros to the outputs that are kept and multiplies the state by exp(0) = 1.

On ONNX (without a rule torch.onnx captures the unrolled chunk loop and ONNX Runtime fails past the sample's chunk
count: qwen3_5_moe_text exported from its 8-token sample failed 'BroadcastIterator::Append axis == 1 || axis ==
largest' in a Mul on 73 and 138 tokens), the same scan runs with its inputs detached, since torch.onnx's
type-promotion pass runs scan's autograd path otherwise and fails, as Mamba-1's did; torch.onnx then writes an ONNX
`Scan` loop.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hfexport.rewrites.example_models import token_inputs
from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, ModuleFunctionPatch
from hfexport.rewrites.rule import PerBackend, RuleMeta, ScanCause
from hfexport.rewrites.rules.patch._delta_rule import detached_scan_input, unit_lower_inverse

FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid", "lara_mini", "qwen4_exp")


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # The same formula as the modules' `l2norm` (FLA's convention), so numerics do not move.
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def scan_chunk_gated_delta_rule(
    original: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    detach_scan_inputs: bool = False,
    **kwargs: Any,
) -> Any:
    """Upstream's `torch_chunk_gated_delta_rule`, scanned; `detach_scan_inputs` cuts the scan's inputs from autograd
    (for torch.onnx: the ONNX variant below), which changes no value."""
    batch_size, sequence_length, num_k_heads, k_head_dim = key.shape
    # A static length traces fine as it is (the unrolled loop is exact for that length); the rewrite is for a
    # symbolic one, where it must not cost an extra chunk for nothing.
    if not isinstance(sequence_length, torch.SymInt):
        return NOT_APPLICABLE
    from torch._higher_order_ops.scan import scan

    initial_dtype = query.dtype
    num_v_heads, v_head_dim = value.shape[-2:]
    if num_k_heads != num_v_heads:
        query = query.repeat_interleave(num_v_heads // num_k_heads, dim=2)
        key = key.repeat_interleave(num_v_heads // num_k_heads, dim=2)
    query, key, value, beta, decay = [
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format) for x in (query, key, value, beta, g)
    ]
    if use_qk_l2norm_in_kernel:
        query, key = _l2norm(query), _l2norm(key)
    query = query * query.shape[-1] ** -0.5

    # Explicit count (no `-1` for torch to infer) plus one whole chunk of padding: see the module docstring.
    num_chunks = (sequence_length + chunk_size - 1) // chunk_size + 1
    pad_size = num_chunks * chunk_size - sequence_length
    query, key, value = (F.pad(x, (0, 0, 0, pad_size)) for x in (query, key, value))
    beta, decay = (F.pad(x, (0, pad_size)) for x in (beta, decay))
    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, k_beta, v_beta = [
        x.reshape(x.shape[0], x.shape[1], num_chunks, chunk_size, x.shape[-1]) for x in (query, key, k_beta, v_beta)
    ]
    decay = decay.reshape(decay.shape[0], decay.shape[1], num_chunks, chunk_size)

    # Intra-chunk quantities, as upstream computes them (batched over all chunks).
    strictly_upper_mask = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    cum_decay = decay.cumsum(dim=3)
    pairwise_decay = (cum_decay.unsqueeze(4) - cum_decay.unsqueeze(3)).masked_fill(strictly_upper_mask, float("-inf"))
    pairwise_decay = pairwise_decay.exp()
    ut_system = (k_beta @ key.transpose(-1, -2)) * pairwise_decay
    intra_chunk_attn = (query @ key.transpose(-1, -2)) * pairwise_decay
    decayed_k_beta = k_beta * cum_decay.exp().unsqueeze(-1)
    ut_inverse = unit_lower_inverse(ut_system)
    new_values, k_cumdecay = ut_inverse @ v_beta, ut_inverse @ decayed_k_beta

    if initial_state is None:
        state = torch.zeros(
            (batch_size, num_v_heads, k_head_dim, v_head_dim), dtype=new_values.dtype, device=new_values.device
        )
    else:
        state = initial_state.to(new_values)
    query = query * cum_decay.exp().unsqueeze(-1)
    key = key * (cum_decay[..., -1:] - cum_decay).exp().unsqueeze(-1)
    chunk_decay = cum_decay[..., -1].exp()[..., None, None]

    def step(state: torch.Tensor, xs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        # Upstream's loop body, in its order of operations, for one chunk.
        new_v, k_cd, q, intra, c_decay, k = xs
        v_new = new_v - k_cd @ state
        out = q @ state + intra @ v_new
        return state * c_decay + k.transpose(-1, -2) @ v_new, out

    per_chunk = tuple(x.movedim(2, 0) for x in (new_values, k_cumdecay, query, intra_chunk_attn, chunk_decay, key))
    if detach_scan_inputs:
        state, per_chunk = detached_scan_input(state), tuple(detached_scan_input(x) for x in per_chunk)
    state, outputs = scan(step, state, per_chunk)
    core_attn_out = outputs.movedim(0, 2).reshape(batch_size, num_v_heads, num_chunks * chunk_size, v_head_dim)
    # pad_size >= 1, so this slice never spans the whole padded length and torch's contiguity question
    # has the same answer for every length (no guard that pins "multiple of chunk_size").
    core_attn_out = core_attn_out[:, :, :sequence_length].transpose(1, 2)
    core_attn_out = core_attn_out.to(initial_dtype, memory_format=torch.contiguous_format)
    return core_attn_out, (state if output_final_state else None)


def _linear_attention_layer_kwargs() -> dict[str, Any]:
    # Grouped value heads (4 value heads over 2 key heads) exercise the repeat_interleave branch.
    return {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_conv_kernel_dim": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "layer_types": ["linear_attention"],
    }


def qwen3_next_example(tokens: int) -> tuple[torch.nn.Module, dict[str, Any]]:
    from transformers import Qwen3NextConfig, Qwen3NextModel

    torch.manual_seed(0)
    config = Qwen3NextConfig(**_linear_attention_layer_kwargs(), num_experts=0, mlp_only_layers=[0])
    return Qwen3NextModel(config).eval(), {"input_ids": torch.randint(0, 64, (2, tokens)), "use_cache": False}


def _qwen3_5(tokens: int) -> tuple[torch.nn.Module, dict[str, Any]]:
    from transformers import Qwen3_5TextConfig, Qwen3_5TextModel

    torch.manual_seed(0)
    config = Qwen3_5TextConfig(**_linear_attention_layer_kwargs())
    return Qwen3_5TextModel(config).eval(), {"input_ids": torch.randint(0, 64, (2, tokens)), "use_cache": False}


def scan_chunk_gated_delta_rule_onnx(original: Any, *args: Any, **kwargs: Any) -> Any:
    return scan_chunk_gated_delta_rule(original, *args, detach_scan_inputs=True, **kwargs)


gated_delta_chunk_scan_hop = ModuleFunctionPatch(
    RuleMeta(
        id="patch/gated-delta-chunk-scan-hop",
        why="Qwen3-Next-style linear attention exports with the sample's 64-token chunk count baked in "
        "(`for i in range(num_chunks)` plus size-1 guards): exported from 8 tokens, the Dynamo program fails "
        "'Guard failed: ... // 64 == 1' on 65 or 128 tokens, and ONNX Runtime fails past 64 tokens "
        "(qwen3_5_moe_text from 8 tokens, 73 tokens: 'BroadcastIterator::Append axis == 1 || axis == largest' in a "
        "Mul); a scan op keeps the count symbolic, its inputs detached on ONNX (torch.onnx's fake re-run of the "
        "program with grad enabled fails on scan's autograd path)",
        upstream="transformers==5.24.0 models/qwen3_next/modeling_qwen3_next.py torch_chunk_gated_delta_rule (and its "
        "copies); torch 0/1 specialisation of derived sizes (cf. https://github.com/pytorch/pytorch/issues/151582); "
        "torch.onnx type promotion running `scan`'s autograd path on fake tensors",
        backends=("dynamo", "onnx"),
        models=FAMILIES,
        aliases=("patch/gated-delta-chunk-scan-onnx",),
        scan=(
            ScanCause(
                "gated-delta-chunk-loop",
                "loop-over-shape",
                "torch_chunk_gated_delta_rule",
                "a Python loop over the chunks of linear attention: the chunk count is baked in",
            ),
        ),
        examples=(
            Match(
                lambda: qwen3_next_example(8),
                "qwen3_next from 8 tokens (one chunk), then 2*64+3 tokens and another batch",
                other_inputs=lambda: token_inputs(3, 2 * 64 + 3),
            ),
            Match(
                lambda: _qwen3_5(8),
                "qwen3_5 from 8 tokens, then exactly two chunks (128 tokens)",
                other_inputs=lambda: token_inputs(2, 128),
                backends=("dynamo",),
            ),
            NoMatch(
                lambda: qwen3_next_example(8),
                "qwen3_next exported for 8 tokens only (static)",
                reason="the replacement declines a concrete sequence length: the original's unrolled loop is exact",
                backends=("dynamo",),
            ),
            NoMatch(
                lambda: qwen3_next_example(8),
                "qwen3_next exported for 8 tokens only (static), to ONNX",
                reason="the replacement declines a concrete sequence length: the original's unrolled loop is exact",
                backends=("onnx",),
                slow=True,  # 46 s on the 2-core CI machine
            ),
        ),
    ),
    target=tuple(f"transformers.models.{f}.modeling_{f}.torch_chunk_gated_delta_rule" for f in FAMILIES),
    replacement=PerBackend(dynamo=scan_chunk_gated_delta_rule, onnx=scan_chunk_gated_delta_rule_onnx),
)
