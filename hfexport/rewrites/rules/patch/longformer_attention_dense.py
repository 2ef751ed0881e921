"""Longformer-style sliding-window + global attention, written as masked dense attention.

`LongformerSelfAttention.forward` (and LED's encoder copy, `LEDEncoderSelfAttention`) cannot be exported with a
symbolic length:

- `_chunk` builds the overlapping windows with `as_strided` on a view whose chunk count is
  `torch.div(L, 2w)`, and torch.export cannot decide the strides ("Could not guard on data-dependent expression
  4*u1 < 8" in `_compute_stride`);
- the layer branches on `is_global_attn = is_index_global_attn.flatten().any().item()` (a Python bool of the
  input's values: "Eq(u0, 1)"), and the global branch sizes its tensors by `num_global.max()`, `nonzero()` and
  `len(...)` of them, which torch.export can only trace as data-dependent sizes.

What the layer computes, for query i and key j (scores q_i . k_j with q scaled by 1/sqrt(head_dim)):
a query attends to the keys of its window |i - j| <= w (a key that is padding or global there gets the dtype's
minimum added, so it weighs exactly 0 next to the query's own key) and to every global key j (a separate column,
without that bias); the softmax runs in float32 over those columns, rows of padding queries are then zeroed.
A global query's row is replaced by its own attention over every key with the `*_global` projections, padding
keys at the dtype's minimum. The replacement computes the same columns over the whole [L, L] square, with
-inf where the original has no column (outside the window, non-global keys in the global part), which weigh 0
as the original's absent columns do; its sums run in another order (differences of float rounding only). It
has no data-dependent size and no branch on the input's values; memory grows with L^2 per head instead of
L * (2w + 1), so very long inputs cost more than eager. It declines training (dropout) and
`output_attentions=True` (the original's probability layout has a data-dependent width).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, MethodPatch
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.patch._longformer import longformer_example, longformer_inputs, roberta_example

_PROJECTIONS = ("query", "key", "value", "query_global", "key_global", "value_global")


def is_longformer_attention(module: torch.nn.Module) -> bool:
    """A self-attention with Longformer's sliding-window chunking and separate global projections."""
    return (
        all(isinstance(getattr(module, name, None), torch.nn.Linear) for name in _PROJECTIONS)
        and isinstance(getattr(module, "one_sided_attn_window_size", None), int)
        and callable(getattr(type(module), "_sliding_chunks_query_key_matmul", None))
        and callable(getattr(type(module), "_get_global_attn_indices", None))
    )


def _heads(x: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    batch, length = x.shape[0], x.shape[1]
    return x.view(batch, length, heads, head_dim).transpose(1, 2)  # [B, H, L, D]


def dense_forward(
    original: Any,
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    is_index_masked: torch.Tensor | None = None,
    is_index_global_attn: torch.Tensor | None = None,
    is_global_attn: Any = None,
    output_attentions: bool = False,
) -> Any:
    if self.training or output_attentions or attention_mask is None:
        return NOT_APPLICABLE
    if is_index_masked is None or is_index_global_attn is None:
        return NOT_APPLICABLE
    batch, length, embed = hidden_states.shape
    heads, head_dim, window = self.num_heads, self.head_dim, self.one_sided_attn_window_size
    scale = math.sqrt(head_dim)

    query = _heads(self.query(hidden_states) / scale, heads, head_dim)
    key = _heads(self.key(hidden_states), heads, head_dim)
    value = _heads(self.value(hidden_states), heads, head_dim)
    scores = torch.matmul(query, key.transpose(-1, -2))  # [B, H, L, L]

    lowest = torch.finfo(scores.dtype).min
    positions = torch.arange(length, device=hidden_states.device)
    in_window = (positions[None, :] - positions[:, None]).abs() <= window  # [L(query), L(key)]
    # The window's keys that are padding or global (the layer's mask is -10000 / 0 / +10000): the dtype's minimum.
    removed = (attention_mask != 0)[:, None, None, :]
    window_bias = torch.zeros((), dtype=scores.dtype, device=scores.device).masked_fill(removed, lowest)
    absent = torch.tensor(float("-inf"), dtype=scores.dtype, device=scores.device)
    local = torch.where(in_window, scores + window_bias, absent)
    global_keys = torch.where(is_index_global_attn[:, None, None, :], scores, absent)
    probs = torch.softmax(torch.cat((global_keys, local), dim=-1), dim=-1, dtype=torch.float32)
    probs = probs.masked_fill(is_index_masked[:, None, :, None], 0.0).type_as(scores)
    weights = probs[..., :length] + probs[..., length:]
    output = torch.matmul(weights, value)  # [B, H, L, D]

    # Global queries: their own projections, over every key but padding.
    global_query = _heads(self.query_global(hidden_states) / scale, heads, head_dim)
    global_key = _heads(self.key_global(hidden_states), heads, head_dim)
    global_value = _heads(self.value_global(hidden_states), heads, head_dim)
    global_scores = torch.matmul(global_query, global_key.transpose(-1, -2))
    global_scores = global_scores.masked_fill(is_index_masked[:, None, None, :], torch.finfo(global_scores.dtype).min)
    global_probs = torch.softmax(global_scores, dim=-1, dtype=torch.float32).type_as(global_scores)
    global_output = torch.matmul(global_probs, global_value)

    output = torch.where(is_index_global_attn[:, None, :, None], global_output, output)
    return (output.transpose(1, 2).reshape(batch, length, embed),)


# -- examples --------------------------------------------------------------------------------------------------


def _model() -> tuple[torch.nn.Module, dict[str, Any]]:
    return longformer_example(), longformer_inputs(2, 13, pad=3, globals_at=(0, 5))


def _classifier() -> tuple[torch.nn.Module, dict[str, Any]]:
    # The classifier puts global attention on the first token of every row itself when none is given.
    inputs = longformer_inputs(2, 9, pad=2, globals_at=(0,))
    inputs.pop("global_attention_mask")
    return longformer_example("classifier"), inputs


longformer_attention_dense = MethodPatch(
    RuleMeta(
        id="patch/longformer-attention-dense",
        why="Longformer's and LED's sliding-window attention builds overlapping chunks with as_strided over "
        "torch.div(L, 2w) chunks ('Could not guard on data-dependent expression 4*u1 < 8' in _compute_stride) "
        "and branches on `is_index_global_attn.any().item()` with global-token counts from nonzero() and len() "
        "(data-dependent sizes); the same attention written as masked dense attention (window and global "
        "columns with -inf where the original has none) has a symbolic length and no branch on the input",
        upstream="transformers==5.24.0 models/longformer/modeling_longformer.py LongformerSelfAttention.forward "
        "(copied to models/led/modeling_led.py LEDEncoderSelfAttention)",
        models=("longformer", "led"),
        examples=(
            Match(
                _model,
                "two layers (windows 4 and 8), row 0 with global tokens 0 and 5, row 1 with none and 3 padding "
                "tokens; then batch 3 and 37 tokens, past both windows",
                other_inputs=lambda: longformer_inputs(3, 37, pad=11, globals_at=(0, 20, 36)),
                atol=1e-5,
                known_failure={
                    "openvino": "openvino.convert_model fails in its normalize step on the model's own padding to the "
                    "window size (slice_shape_inference.hpp:72 'shape_rank.compatible(1)', then 'No conversion rule "
                    "found for operations: <built-in function mod>'), outside the rule's attention: an OpenVINO "
                    "coverage gap of Longformer (#17)"
                },
            ),
            Match(
                _classifier,
                "sequence classifier (global attention on the first token, set by the model)",
                other_inputs=lambda: {
                    k: v
                    for k, v in longformer_inputs(1, 26, pad=5, globals_at=(0,)).items()
                    if k != "global_attention_mask"
                },
                atol=1e-5,
                known_failure={"openvino": "as Match 0 on OpenVINO (the window padding's slice)"},
            ),
            NoMatch(
                roberta_example,
                "RoBERTa (Longformer's embeddings, full self-attention)",
                reason="no module has the sliding-window chunking and the global projections",
                applies=False,
            ),
        ),
    ),
    target=is_longformer_attention,
    method="forward",
    replacement=dense_forward,
)
