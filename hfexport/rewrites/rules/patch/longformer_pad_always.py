"""Longformer: pad to the attention window by a length that is never zero.

`LongformerModel._pad_to_window_size` pads the inputs to a multiple of the attention window only
`if padding_len > 0`, and the encoder removes the padding at the end with `hidden_states[:, : L - padding_len]`.
torch.export keeps what the sample saw: the branch ("Guard failed: (4 + -1 * (input_ids.size()[1] % 4)) % 4 > 0"
at a multiple of the window), and, through the contiguity of that final slice, whether the padding is empty
('16 * L + 16 * padding != 16 * L', and 'batch * padding >= 2' for a batch of one). Padding unconditionally by
`(window - L % window) % window + window` (one more whole window) makes every length take the same path: the
padding is never empty and never a single row. The extra tokens are padding like the original's (the pad token
id, attention mask 0, token type 0, the pad token's position id): every attention masks them as keys (the
window's dtype-minimum bias and the global attention's padding mask weigh them exactly 0), no other layer mixes
tokens, and the encoder cuts them off, so the outputs are the original's; the cost is one window more of tokens.
Given `inputs_embeds`, the model numbers every position, padding included, so the extra window could run past
the position table where the original does not: the replacement declines those calls.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, MethodPatch
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.patch._longformer import longformer_example, longformer_inputs, roberta_example


def pad_always(
    original: Any,
    self: torch.nn.Module,
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor,
    token_type_ids: torch.Tensor,
    position_ids: torch.Tensor | None,
    inputs_embeds: torch.Tensor | None,
    pad_token_id: int,
) -> Any:
    if inputs_embeds is not None or input_ids is None:
        return NOT_APPLICABLE
    windows = self.config.attention_window
    window = windows if isinstance(windows, int) else max(windows)
    length = input_ids.shape[1]
    padding_len = (window - length % window) % window + window
    input_ids = functional.pad(input_ids, (0, padding_len), value=pad_token_id)
    if position_ids is not None:
        # As the original: padding positions get the pad token's id (RoBERTa's position convention).
        position_ids = functional.pad(position_ids, (0, padding_len), value=pad_token_id)
    attention_mask = functional.pad(attention_mask, (0, padding_len), value=0)
    token_type_ids = functional.pad(token_type_ids, (0, padding_len), value=0)
    return padding_len, input_ids, attention_mask, token_type_ids, position_ids, inputs_embeds


def _model() -> tuple[torch.nn.Module, dict[str, Any]]:
    return longformer_example(), longformer_inputs(2, 7, pad=2, globals_at=(0,))


def _inputs_at(batch: int, length: int) -> dict[str, Any]:
    return longformer_inputs(batch, length, pad=0, globals_at=(0,))


def _model_at(batch: int, length: int) -> tuple[torch.nn.Module, dict[str, Any]]:
    return longformer_example(), _inputs_at(batch, length)


def _multiple() -> dict[str, Any]:
    return longformer_inputs(3, 16, pad=4, globals_at=(0, 9))  # a multiple of the window (8): no padding


def _embeds() -> tuple[torch.nn.Module, dict[str, Any]]:
    model, inputs = _model()
    ids = inputs.pop("input_ids")
    return model, {**inputs, "inputs_embeds": model.embeddings.word_embeddings(ids).detach()}


longformer_pad_always = MethodPatch(
    RuleMeta(
        id="patch/longformer-pad-always",
        why="LongformerModel pads its inputs to a multiple of the attention window only `if padding_len > 0` and "
        "slices the padding off at the end: the export keeps the sample's branch and the slice's contiguity and "
        "refuses other lengths ('Guard failed: (4 + -1 * (input_ids.size()[1] % 4)) % 4 > 0' at 12 tokens); "
        "padding by one more window every time (masked pad tokens, cut off again) gives every length one path "
        "and the same outputs",
        upstream="transformers==5.24.0 models/longformer/modeling_longformer.py LongformerModel._pad_to_window_size",
        models=("longformer",),
        examples=(
            Match(
                _model,
                "7 tokens (padded to 8), a padded row; then batch 3 and 16 tokens, a multiple of the window",
                other_inputs=_multiple,
                needs=("patch/longformer-attention-dense",),
                known_failure={
                    "openvino": "as patch/longformer-attention-dense on OpenVINO (the window padding's slice in "
                    "convert_model's normalize step)"
                },
            ),
            Match(
                lambda: _model_at(2, 16),
                "16 tokens, a multiple of the window (8); then batch 1 and 13 tokens",
                other_inputs=lambda: _inputs_at(1, 13),
                needs=("patch/longformer-attention-dense",),
                known_failure={"openvino": "as Match 0 on OpenVINO"},
            ),
            NoMatch(
                _embeds,
                "inputs_embeds instead of token ids",
                reason="declined: with inputs_embeds the model numbers the padding's positions too, and one more "
                "window could run past the position table",
            ),
            NoMatch(
                roberta_example,
                "RoBERTa (no window padding)",
                reason="the patch targets LongformerModel only",
                applies=False,
            ),
        ),
    ),
    target="transformers.models.longformer.modeling_longformer.LongformerModel._pad_to_window_size",
    replacement=pad_always,
)
