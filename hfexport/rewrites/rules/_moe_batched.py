"""transformers' `grouped_mm` experts run one expert at a time over the tokens routed to it during the trace.

The body, target and examples of `patch/moe-batched-experts`, and the tiny MoE models other rules' examples use
(`patch/identity-experts-routed-loop`, `aten/grouped-mm-fallback`).
"""

from __future__ import annotations

from typing import Any

import torch

from hfexport.rewrites.example_models import tiny_model
from hfexport.rewrites.examples import Built, Match, NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE

MODELS = ("qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss", "granitemoehybrid")


def dispatches_experts(module: torch.nn.Module) -> bool:
    # transformers' `use_experts_implementation` decorator gives an experts class these attributes and a
    # forward that dispatches on `config._experts_implementation`.
    return all(hasattr(module, a) for a in ("_is_expert_parallel", "has_gate", "is_transposed", "config"))


def _declines(module: torch.nn.Module) -> bool:
    from transformers.integrations import moe

    return (
        getattr(module.config, "_experts_implementation", None) != "grouped_mm"
        or moe.ALL_EXPERTS_FUNCTIONS.get("grouped_mm") is not moe.grouped_mm_experts_forward
        or module._is_expert_parallel
    )


def routed_experts(original: Any, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    # No sort or histc (refused by OpenVINO's converter and by to_edge) and no grouped_mm kernel (none in XNNPACK
    # or the portable kernels).
    if _declines(module):
        return NOT_APPLICABLE
    return routed_experts_forward(module, *args, **kwargs)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    # One expert's weight: [out, in], or [in, out] for transposed experts (gpt_oss).
    out = x @ weight if transposed else x @ weight.t()
    return out if bias is None else out + bias


def routed_experts_forward(
    module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers' experts forward, one expert at a time over the (token, slot) pairs routed to it.

    transformers' `batched_mm` form gathers every pair's expert weights (`gate_up_proj[expert_ids]`: `[tokens *
    top_k, 2 * inter, hidden]`), so its memory and FLOPs grow with tokens x expert weights (26 GB per
    projection for a 512-token Qwen3-30B-A3B prefill). Here a loop over the experts (bounded by the expert
    count, unrolled by the trace) picks each expert's pairs with `nonzero`, gathers their rows with
    `index_select`, multiplies by that expert's own weights, and adds the weighted rows back (`scatter_add`):
    memory and FLOPs grow with tokens x top_k. An expert without tokens gets an empty selection (a 0-row matmul).
    Each pair is computed exactly as in `batched_mm` (same products, gate, bias, routing weight and
    dtype promotion); only the order in which a token's top_k contributions are summed differs.
    """
    num_tokens, hidden_dim = hidden_states.shape[0], hidden_states.shape[-1]
    up = module.gate_up_proj if module.has_gate else module.up_proj
    up_bias = (module.gate_up_proj_bias if module.has_gate else module.up_proj_bias) if module.has_bias else None
    down_bias = module.down_proj_bias if module.has_bias else None
    # batched_mm multiplies the expert output by the routing weights, then sums: the result dtype of that product.
    dtype = torch.promote_types(hidden_states.dtype, top_k_weights.dtype)
    out = hidden_states.new_zeros((num_tokens, hidden_dim), dtype=dtype)
    top_k = top_k_index.shape[-1]
    flat_index, flat_weights = top_k_index.reshape(-1), top_k_weights.reshape(-1)
    for expert in range(up.shape[0]):
        # The flat (token, slot) pairs routed to this expert, from nonzero over the flat routing: a 1-D mask, so
        # no column of nonzero's [pairs, 2] result is sliced (that result is column-major, and the ExecuTorch
        # program slicing it failed at run time: slice_copy "different dim orders", 0x12).
        pair = torch.nonzero(flat_index == expert).reshape(-1)
        token = torch.div(pair, top_k, rounding_mode="floor")
        h = _linear(hidden_states.index_select(0, token), up[expert], _at(up_bias, expert), module.is_transposed)
        h = module._apply_gate(h) if module.has_gate else module.act_fn(h)
        h = _linear(h, module.down_proj[expert], _at(down_bias, expert), module.is_transposed)
        if module.has_post_expert_norm:
            h = module.post_expert_norm(h)
        weighted = h * flat_weights.index_select(0, pair).unsqueeze(-1)
        # scatter_add, not index_add: OpenVINO's converter refuses aten.index_add without its alpha argument.
        out = out.scatter_add(0, token.unsqueeze(-1).expand_as(weighted), weighted)
    return out.to(hidden_states.dtype)


def _at(bias: torch.Tensor | None, expert: int) -> torch.Tensor | None:
    return None if bias is None else bias[expert]


def qwen3_moe(tokens: int, experts: int = 4, implementation: str | None = None) -> Built:
    model, inputs = tiny_model(
        "Qwen3MoeConfig",
        "Qwen3MoeModel",
        tokens=tokens,
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=experts,
        num_experts_per_tok=2,
    )
    if implementation is not None:
        model.set_experts_implementation(implementation)
    return model, inputs


def gpt_oss(tokens: int) -> Built:
    # Transposed experts with biases and their own gate: the other weight layout batched_mm must reproduce.
    return tiny_model(
        "GptOssConfig",
        "GptOssModel",
        tokens=tokens,
        vocab_size=64,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["full_attention"],
    )


EXAMPLES = (
    Match(
        lambda: qwen3_moe(7),
        "odd token count, 4 experts, then another batch and length",
        other_inputs=lambda: {"input_ids": torch.randint(0, 64, (3, 4)), "use_cache": False},
    ),
    Match(lambda: qwen3_moe(1, experts=8), "a single token: most experts get no rows"),
    # ExecuTorch: gpt_oss's attention sinks take a max over the heads that XNNPACK's amax refuses.
    Match(lambda: gpt_oss(5), "transposed experts with biases", needs=("executorch/max-values-as-amax",)),
    NoMatch(
        lambda: qwen3_moe(5, implementation="batched_mm"),
        "experts already set to batched_mm",
        reason="the replacement declines experts whose implementation is not grouped_mm",
    ),
)
