"""Kimi delta attention (KDA): the chunk loop as a `scan` higher-order op.

transformers' pure-torch `chunk_kimi_delta_attention` (copied verbatim into kimi_linear, bailing_hybrid and
glm5_next) runs `for i in range(total_sequence_length // chunk_size)` over 64-token chunks and solves each chunk's
UT system by forward substitution (`for i in range(1, chunk_size)` with in-place row writes), so torch.export
unrolls both and the program keeps the sample's chunk count: exported from 8 tokens it fails
'Guard failed: input_ids.size()[1] <= 64' on 73 tokens. The same size-1 guards as the gated delta rule's apply
(see `gated_delta_chunk_scan_hop`): the `-1` chunk reshapes, the in-place row writes, the final padding slice.

KDA differs from the gated delta rule only in its decay: `g` is a log-decay per key channel ([B, T, H, K]),
not per head, so the pairwise decay is a [C, C, K] tensor summed over K with the key products, exactly as
upstream writes it (kept here, not re-associated into matmuls, so the numbers do not move). The replacement
counts chunks explicitly and pads at least one whole chunk (zero query, key, value, beta and log-decay: exact
zeros added to the kept outputs, the state multiplied by exp(0) = 1), inverts the UT system loop-free
(`_delta_rule.unit_lower_inverse`) and scans over chunks with `torch._higher_order_ops.scan`.

On ONNX (without a rule torch.onnx captures the unrolled chunk loop and ONNX Runtime fails past the sample's chunk
count: bailing_hybrid and kimi_linear exported from 8 tokens failed 'Non-zero status code returned while running
Slice node' on 73 and 138 tokens), the same scan runs with its inputs detached, since torch.onnx's type-promotion
pass runs scan's autograd path otherwise and fails, as Mamba-1's did; torch.onnx then writes an ONNX `Scan` loop.
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

# The modules that define `chunk_kimi_delta_attention` (grep over transformers/models, transformers==5.24.0).
FAMILIES = ("kimi_linear", "bailing_hybrid", "glm5_next")


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    # The KDA modules' `l2norm`: divide by the square root (not Qwen's multiply by rsqrt), so numerics do not move.
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def scan_chunk_kimi_delta_attention(original: Any, *args: Any, **kwargs: Any) -> Any:
    return chunk_scan(*args, detach_scan_inputs=False, **kwargs)


def chunk_scan(
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
    detach_scan_inputs: bool,
    **kwargs: Any,
) -> Any:
    """upstream's `chunk_kimi_delta_attention`, scanned; `detach_scan_inputs` cuts the scan's inputs from autograd
    (for torch.onnx: the ONNX variant below), which changes no value."""
    batch_size, sequence_length, num_heads, k_head_dim = key.shape
    # A static length traces fine as it is (the unrolled loops are exact for that length); the rewrite is for a
    # symbolic one, where it must not cost an extra chunk for nothing.
    if not isinstance(sequence_length, torch.SymInt):
        return NOT_APPLICABLE
    from torch._higher_order_ops.scan import scan

    initial_dtype = query.dtype
    v_head_dim = value.shape[-1]
    query, key, value, beta, g = [
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format) for x in (query, key, value, beta, g)
    ]
    if use_qk_l2norm_in_kernel:
        query, key = _l2norm(query), _l2norm(key)
    query = query * (1 / (query.shape[-1] ** 0.5))

    # Explicit count (no `-1` for torch to infer) plus one whole chunk of padding: see gated_delta_chunk_scan_hop.
    num_chunks = (sequence_length + chunk_size - 1) // chunk_size + 1
    pad_size = num_chunks * chunk_size - sequence_length
    query, key, value, g = (F.pad(x, (0, 0, 0, pad_size)) for x in (query, key, value, g))
    beta = F.pad(beta, (0, pad_size))
    v_beta = value * beta.unsqueeze(-1)
    k_beta = key * beta.unsqueeze(-1)
    query, key, g, k_beta, v_beta = [
        x.reshape(x.shape[0], x.shape[1], num_chunks, chunk_size, x.shape[-1]) for x in (query, key, g, k_beta, v_beta)
    ]

    # Intra-chunk quantities, as upstream computes them (batched over all chunks); decays per key channel.
    g = g.cumsum(dim=-2)
    strict_mask = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=query.device).triu(1)
    decay_mask = (g.unsqueeze(-2) - g.unsqueeze(-3)).masked_fill(strict_mask[..., None], float("-inf")).exp()
    ut_system = (k_beta.unsqueeze(-2) * key.unsqueeze(-3) * decay_mask).sum(dim=-1)
    ut_inverse = unit_lower_inverse(ut_system)
    new_values, k_cumdecay = ut_inverse @ v_beta, ut_inverse @ (k_beta * g.exp())
    intra_chunk_attn = (query.unsqueeze(-2) * key.unsqueeze(-3) * decay_mask).sum(dim=-1).masked_fill(strict_mask, 0)

    if initial_state is None:
        state = torch.zeros(
            (batch_size, num_heads, k_head_dim, v_head_dim), dtype=new_values.dtype, device=new_values.device
        )
    else:
        state = initial_state.to(new_values)
    query = query * g.exp()
    key = key * (g[..., -1:, :] - g).exp()
    chunk_decay = g[..., -1, :].exp().unsqueeze(-1)

    def step(state: torch.Tensor, xs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        # Upstream's loop body, in its order of operations, for one chunk.
        new_v, k_cd, q, intra, c_decay, k = xs
        attn_inter = q @ state
        v_new = new_v - k_cd @ state
        out = attn_inter + intra @ v_new
        return state * c_decay + k.transpose(-1, -2) @ v_new, out

    per_chunk = tuple(x.movedim(2, 0) for x in (new_values, k_cumdecay, query, intra_chunk_attn, chunk_decay, key))
    if detach_scan_inputs:
        state, per_chunk = detached_scan_input(state), tuple(detached_scan_input(x) for x in per_chunk)
    state, outputs = scan(step, state, per_chunk)
    core_attn_out = outputs.movedim(0, 2).reshape(batch_size, num_heads, num_chunks * chunk_size, v_head_dim)
    # pad_size >= 1, so this slice never spans the whole padded length (no "multiple of chunk_size" guard).
    core_attn_out = core_attn_out[:, :, :sequence_length].transpose(1, 2)
    core_attn_out = core_attn_out.to(initial_dtype, memory_format=torch.contiguous_format)
    return core_attn_out, (state if output_final_state else None)


def _kda_layer_kwargs() -> dict[str, Any]:
    # One KDA layer, sized like the corpus fixtures (tests/fixtures/corpus_all/causal_lm/bailing_hybrid.json).
    return {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_head_dim": 16,
        "linear_num_heads": 2,
        "linear_conv_kernel_dim": 4,
        "layer_types": ["linear_attention"],
        "mlp_layer_types": ["dense"],
        "pad_token_id": 63,
        "eos_token_id": 62,
        "bos_token_id": 61,
    }


def bailing_hybrid_example(tokens: int, layer_type: str = "linear_attention") -> tuple[torch.nn.Module, dict[str, Any]]:
    from transformers import BailingHybridConfig, BailingHybridModel

    torch.manual_seed(0)
    config = BailingHybridConfig(**{**_kda_layer_kwargs(), "layer_types": [layer_type]})
    return BailingHybridModel(config).eval(), {"input_ids": torch.randint(0, 64, (2, tokens)), "use_cache": False}


def kimi_linear_example(tokens: int) -> tuple[torch.nn.Module, dict[str, Any]]:
    from transformers import KimiLinearConfig, KimiLinearModel

    torch.manual_seed(0)
    config = KimiLinearConfig(**_kda_layer_kwargs())
    return KimiLinearModel(config).eval(), {"input_ids": torch.randint(0, 64, (2, tokens)), "use_cache": False}


def scan_chunk_kimi_delta_attention_onnx(original: Any, *args: Any, **kwargs: Any) -> Any:
    return chunk_scan(*args, detach_scan_inputs=True, **kwargs)


kimi_delta_chunk_scan_hop = ModuleFunctionPatch(
    RuleMeta(
        id="patch/kimi-delta-chunk-scan-hop",
        why="Kimi delta attention exports with the sample's 64-token chunk count baked in "
        "(`for i in range(total_sequence_length // chunk_size)`, per-row forward substitution, size-1 guards): "
        "exported from 8 tokens, bailing_hybrid's Dynamo program fails 'Guard failed: input_ids.size()[1] <= 64' on "
        "73 tokens, and ONNX Runtime fails past 64 tokens (bailing_hybrid and kimi_linear, 73 tokens: 'Non-zero "
        "status code returned while running Slice node'); a scan op keeps the count symbolic, its inputs detached "
        "on ONNX (torch.onnx's fake re-run of the program with grad enabled fails on scan's autograd path)",
        upstream="transformers==5.24.0 models/kimi_linear/modeling_kimi_linear.py chunk_kimi_delta_attention (and its "
        "copies in bailing_hybrid, glm5_next); torch 0/1 specialisation of derived sizes "
        "(cf. https://github.com/pytorch/pytorch/issues/151582); torch.onnx type promotion running `scan`'s autograd "
        "path on fake tensors",
        backends=("dynamo", "onnx"),
        models=FAMILIES,
        aliases=("patch/kimi-delta-chunk-scan-onnx",),
        scan=(
            ScanCause(
                "kimi-delta-chunk-loop",
                "loop-over-shape",
                "chunk_kimi_delta_attention",
                "a Python loop over the chunks of Kimi delta attention (and over a chunk's rows): the chunk count is "
                "baked in",
            ),
        ),
        examples=(
            Match(
                lambda: bailing_hybrid_example(8),
                "bailing_hybrid from 8 tokens (one chunk), then 73 tokens and another batch",
                other_inputs=lambda: token_inputs(3, 73),
            ),
            Match(
                lambda: kimi_linear_example(8),
                "kimi_linear from 8 tokens, then exactly two chunks plus ten (138 tokens)",
                other_inputs=lambda: token_inputs(1, 138),
            ),
            # ONNX's default-tier NoMatch: the static-length one below exports the unrolled loops to ONNX twice,
            # about 50 s on 2 cores.
            NoMatch(
                lambda: bailing_hybrid_example(8, layer_type="full_attention"),
                "bailing_hybrid with its attention layer only (no KDA layer)",
                reason="the rule is installed for the module but its function is never called",
                backends=("onnx",),
            ),
            NoMatch(
                lambda: bailing_hybrid_example(8),
                "bailing_hybrid exported for 8 tokens only (static)",
                reason="the replacement declines a concrete sequence length: the original's unrolled loops are exact",
            ),
        ),
    ),
    target=tuple(f"transformers.models.{f}.modeling_{f}.chunk_kimi_delta_attention" for f in FAMILIES),
    replacement=PerBackend(dynamo=scan_chunk_kimi_delta_attention, onnx=scan_chunk_kimi_delta_attention_onnx),
)
