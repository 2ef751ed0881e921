"""Mixture-of-experts forms that rules install, in their own module so that benchmarks measure them by a public
name (tools/bench_moe.py, tools/moe_memory.py); `patch/moe-batched-experts` installs `routed_experts_forward`."""

from __future__ import annotations

import torch


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
