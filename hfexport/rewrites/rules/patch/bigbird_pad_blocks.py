"""BigBird: the block-sparse model pads to whole blocks only when the length is not a multiple already.

`BigBirdModel.forward` (modeling_big_bird.py) pads through `_pad_to_block_size`, whose
`padding_len = (block_size - seq_len % block_size) % block_size` is then tested (`if padding_len > 0`) both to
pad and to cut the padding off the output (`sequence_output[:, :-padding_len]`, which would be empty for 0):
the export keeps the sample's answer, "Guard failed: (8 - L % 8) % 8 <= 0" at 133 tokens for big_bird's
128-token sample. The replacement pads to `ceil(L / block) * block` always (a pad of 0 elements is the input
itself, so multiples are unchanged) and cuts the output back to `L` always (`[:, :L]` of an unpadded output is
all of it; selected by index, as a slice's contiguity would be a guard of its own), with the original's padding
values (pad token, position pad id, mask 0, token type 0).

The switch: eager BigBird turns the whole model to full attention when a call has
`L <= (5 + 2 * num_random_blocks) * block_size` tokens (88 for the corpus' big_bird), and block-sparse and full
attention give other values. Kept in Python, that test held the export to the sample's side (L > 88). Here the
model always pads and the attention (patch/bigbird-block-sparse-dense, which this rule needs) chooses per call
with a tensor test on the padded length (the threshold is a multiple of the block): full attention for short
inputs, as a fresh eager model gives. Eager also makes the switch permanent (`set_attention_type` replaces the
modules, so a later long call stays full); the program does not. A decoder with a cache, training, attention
outputs and every non-block-sparse model decline to the original. Only the query and key masks are made (what
the dense attention reads): the original's blocked and band masks slice the block axis and guard on the block
count, so this rule works only with patch/bigbird-block-sparse-dense, installed with it.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, MethodPatch
from hfexport.rewrites.rule import RuleMeta


def pad_length(length: Any, block_size: int) -> Any:
    """`length` rounded up to whole blocks, written as blocks * block_size so that `% block_size` is 0 for
    torch.export too."""
    return ((length + block_size - 1) // block_size) * block_size


def forward(
    original: Any,
    self: torch.nn.Module,
    input_ids: Any = None,
    attention_mask: Any = None,
    token_type_ids: Any = None,
    position_ids: Any = None,
    inputs_embeds: Any = None,
    encoder_hidden_states: Any = None,
    encoder_attention_mask: Any = None,
    cache: Any = None,
    use_cache: Any = None,
    **kwargs: Any,
) -> Any:
    from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions

    config = self.config
    if self.attention_type != "block_sparse" or config.is_decoder or "past_key_values" in kwargs:
        return NOT_APPLICABLE  # full attention never pads; a decoder (cache) switches to full attention
    if (input_ids is None) == (inputs_embeds is None):
        return NOT_APPLICABLE  # the original's errors
    if self.training or kwargs.get("output_attentions"):
        return NOT_APPLICABLE  # the dense attention that also takes the short side of the switch declines these
    batch_size, seq_length = input_ids.shape if input_ids is not None else inputs_embeds.shape[:2]
    # Changed: no `seq_length <= (5 + 2 * num_random_blocks) * block_size` switch to full attention here; the
    # attention (patch/bigbird-block-sparse-dense) takes the side of it per call.
    device = input_ids.device if input_ids is not None else inputs_embeds.device
    if input_ids is not None:
        self.warn_if_padding_and_no_attention_mask(input_ids, attention_mask)
    if attention_mask is None:
        attention_mask = torch.ones((batch_size, seq_length), device=device)
    if token_type_ids is None:
        if hasattr(self.embeddings, "token_type_ids"):
            token_type_ids = self.embeddings.token_type_ids[:, :seq_length].expand(batch_size, seq_length)
        else:
            token_type_ids = torch.zeros((batch_size, seq_length), dtype=torch.long, device=device)

    # Changed: pad by padded - L always (0 for a multiple), as `_pad_to_block_size` does when it pads.
    padded = pad_length(seq_length, self.block_size)
    padding_len = padded - seq_length
    if input_ids is not None:
        input_ids = nn.functional.pad(input_ids, (0, padding_len), value=config.pad_token_id)
    if position_ids is not None:
        position_ids = nn.functional.pad(position_ids, (0, padding_len), value=config.pad_token_id)
    if inputs_embeds is not None:
        padding_ids = inputs_embeds.new_full((batch_size, padding_len), config.pad_token_id, dtype=torch.long)
        inputs_embeds = torch.cat([inputs_embeds, self.embeddings(padding_ids)], dim=-2)
    attention_mask = nn.functional.pad(attention_mask, (0, padding_len), value=False)
    token_type_ids = nn.functional.pad(token_type_ids, (0, padding_len), value=0)

    embedding_output = self.embeddings(
        input_ids=input_ids,
        position_ids=position_ids,
        token_type_ids=token_type_ids,
        inputs_embeds=inputs_embeds,
        cache_length=0,
    )
    # Changed: only the query and key masks, which the dense attention reads; the blocked and band masks slice
    # the block axis at 2:-2 and the like, sizes that guard on the block count (nb - 4 != 1 at 40 tokens).
    from_mask = attention_mask.view(batch_size, 1, padded, 1)
    to_mask = attention_mask.view(batch_size, 1, 1, padded)
    encoder_outputs = self.encoder(
        embedding_output,
        attention_mask=None,
        encoder_hidden_states=encoder_hidden_states,
        encoder_attention_mask=encoder_attention_mask,
        cache=None,
        use_cache=False,
        band_mask=None,
        from_mask=from_mask,
        to_mask=to_mask,
        blocked_encoder_mask=None,
        **kwargs,
    )
    sequence_output = encoder_outputs.last_hidden_state
    pooler_output = self.activation(self.pooler(sequence_output[:, 0, :])) if self.pooler is not None else None
    # Changed: the first L positions always (all of them when nothing was padded). Selected rather than
    # sliced: whether a slice is the whole tensor (a contiguous view) would be another guard on the length.
    positions = torch.arange(seq_length, device=sequence_output.device)
    sequence_output = sequence_output.index_select(1, positions)
    return BaseModelOutputWithPoolingAndCrossAttentions(
        last_hidden_state=sequence_output,
        pooler_output=pooler_output,
        cache=encoder_outputs.cache,
    )


def _model(attention: str = "block_sparse") -> Any:
    from transformers import BigBirdConfig, BigBirdModel

    torch.manual_seed(0)
    config = BigBirdConfig(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=256,
        block_size=4,
        num_random_blocks=2,
        attention_type=attention,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        sep_token_id=4,
    )
    return BigBirdModel(config).eval()


class _Fresh(torch.nn.Module):
    """BigBird that answers each call as a fresh model: eager's switch to full attention for a short call is made
    permanent by `set_attention_type`, so the wrapper sets block-sparse attention back after every call (a no-op
    when the call was long, and so in the trace of a long sample)."""

    def __init__(self) -> None:
        super().__init__()
        self.model = _model()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        self.model.set_attention_type("block_sparse")
        return hidden


def _inputs(length: int, seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, -3:] = 0  # a padded row
    return {"input_ids": torch.randint(5, 50, (2, length), generator=generator), "attention_mask": mask}


bigbird_pad_blocks = MethodPatch(
    RuleMeta(
        id="patch/bigbird-pad-blocks",
        why="BigBird's block-sparse model pads to whole blocks only when the length is not a multiple "
        "(`if padding_len > 0`, also to cut the output back): the export keeps the sample's answer, "
        "'Guard failed: (8 - L % 8) % 8 <= 0' for a 128-token sample at 133 tokens; padding by "
        "ceil(L / block) * block - L always (0 elements for a multiple) and cutting to [:, :L] always is the same; "
        "its switch to full attention at L <= (5 + 2 * random blocks) * block is left to the attention, per call",
        upstream="transformers==5.24.0 models/big_bird/modeling_big_bird.py BigBirdModel.forward",
        models=("big_bird",),
        examples=(
            Match(
                lambda: (_model(), _inputs(48, 0)),
                "48 tokens (a multiple of the block of 4, nothing padded), then 50 (padded by 2)",
                other_inputs=lambda: _inputs(50, 1),
                needs=("patch/bigbird-block-sparse-dense",),
            ),
            Match(
                lambda: (_Fresh().eval(), _inputs(40, 2)),
                "40 tokens (block-sparse, past 36), then 22 (full attention, as a fresh model)",
                other_inputs=lambda: _inputs(22, 3),
                needs=("patch/bigbird-block-sparse-dense",),
            ),
            NoMatch(
                lambda: (_model("original_full"), _inputs(10, 0)),
                "BigBird with full attention",
                reason="declines: only block-sparse attention pads",
            ),
        ),
    ),
    target="transformers.models.big_bird.modeling_big_bird.BigBirdModel.forward",
    replacement=forward,
)
