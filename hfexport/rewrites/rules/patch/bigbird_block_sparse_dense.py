"""BigBird: block-sparse attention as one masked dense softmax with the same keys, weights and zeros.

`BigBirdBlockSparseAttention.bigbird_block_sparse_attention` (modeling_big_bird.py) builds its random-block
table with numpy from the trace's Python length (`_bigbird_block_rand_mask_with_head`, a constant of shape
heads x (blocks - 2) x random blocks) and slices the blocked queries and keys by the sample's block count: the
program holds the sample's block count in its shapes. On ONNX the model exports and matches eager at the sample
(128 tokens, 16 blocks) and ONNX Runtime fails at 133 tokens (17 blocks) in a Reshape (reshape_helper.h:84).

In eval the random-block table is all zeros (`_bigbird_block_rand_mask*` return `np.zeros` when not training),
so every random block is key block 0. What each query block attends to is then fixed by its block index q and
the block count n (padded length // block size), and a key block b counts this many times in its softmax:

- q = 0 or q = n - 1 (global rows): every key once;
- otherwise: [b == 0 or b == n - 1 or |b - q| <= 1] + num_random_blocks * [b == 0] (block 0 is also each
  random block).

With the eager's scores (q.k / sqrt(d), plus -10000 per masked key as `attn_mask_penalty`), adding log(count)
(-inf for 0) to each score gives every key block exactly the eager's softmax weight (count * exp(score)), and
the output is multiplied by the query mask (`* from_mask`) as the eager does. For a query whose mask is 1 the
eager's band and random masks (query mask x key mask) equal the key mask used here; a masked query's output
is zeroed in both. Sums are taken in another order, so values agree to float rounding. The attention
probabilities the original assembles are not returned (a call asking for them runs the original).

BigBirdModel runs full attention instead when a call has at most (5 + 2 * num_random_blocks) * block_size
tokens; with patch/bigbird-pad-blocks that test is made here, per call, as a tensor: below it every key counts
once and the output is not multiplied by the query mask, which is full attention (masked keys get exactly 0 weight
either way: exp(-10000) underflows as eager's most negative float does; only a row whose keys are all masked
would differ).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, MethodPatch
from hfexport.rewrites.rule import RuleMeta

PENALTY = -10000.0  # the original's `attn_mask_penalty`


def block_counts(length: Any, block_size: int, num_random_blocks: int, device: torch.device) -> torch.Tensor:
    """How many times each key counts in each query's softmax: (length, length), float; length % block_size == 0."""
    blocks = torch.arange(length, device=device) // block_size
    last = length // block_size - 1
    query, key = blocks[:, None], blocks[None, :]
    seen = (key == 0) | (key == last) | ((key - query).abs() <= 1)
    counts = seen.to(torch.float32) + num_random_blocks * (key == 0).to(torch.float32)
    is_global = (query == 0) | (query == last)
    return torch.where(is_global, torch.ones_like(counts), counts)


def dense_block_sparse(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    from_mask: torch.Tensor,
    to_mask: torch.Tensor,
    block_size: int,
    num_random_blocks: int,
) -> torch.Tensor:
    """Eval block-sparse attention of (batch, heads, length, head dim) tensors; masks as the original's."""
    length = query.shape[2]
    counts = block_counts(length, block_size, num_random_blocks, query.device)
    # BigBirdModel's switch, per call: block-sparse only past (5 + 2 * random blocks) * block_size tokens (a multiple
    # of the block, so the padded length decides as the unpadded one), else full attention: every key once and no
    # query mask on the output. A tensor, not a Python test, so the program keeps both sides.
    sparse = torch.arange(length, device=query.device)[-1:] >= (5 + 2 * num_random_blocks) * block_size
    counts = torch.where(sparse, counts, torch.ones_like(counts))
    from_mask = torch.where(sparse, from_mask, torch.ones_like(from_mask))
    scores = torch.matmul(query, key.transpose(-1, -2)) * (1 / math.sqrt(query.shape[-1]))
    scores = scores + (1.0 - to_mask) * PENALTY
    scores = scores + torch.log(counts).to(scores.dtype)
    weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights, value) * from_mask


def forward(
    original: Any,
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    band_mask: Any = None,
    from_mask: Any = None,
    to_mask: Any = None,
    from_blocked_mask: Any = None,
    to_blocked_mask: Any = None,
    **kwargs: Any,
) -> Any:
    if self.training or from_mask is None or to_mask is None or kwargs.get("output_attentions"):
        return NOT_APPLICABLE  # training draws random blocks; the attention probabilities: the original builds them
    batch_size, seqlen, _ = hidden_states.size()
    if isinstance(seqlen, int) and seqlen % self.block_size != 0:
        return NOT_APPLICABLE  # the original's error
    heads, head_size = self.num_attention_heads, self.attention_head_size

    def split(layer: torch.nn.Module) -> torch.Tensor:
        return layer(hidden_states).view(batch_size, -1, heads, head_size).transpose(1, 2)

    context = dense_block_sparse(
        split(self.query),
        split(self.key),
        split(self.value),
        from_mask.to(hidden_states.dtype),
        to_mask.to(hidden_states.dtype),
        self.block_size,
        self.num_random_blocks,
    )
    return context.transpose(1, 2).contiguous().view(batch_size, seqlen, -1), None


def _config(**overrides: Any) -> Any:
    from transformers import BigBirdConfig

    settings = dict(
        vocab_size=50,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=256,
        block_size=4,
        num_random_blocks=2,
        attention_type="block_sparse",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    settings.update(overrides)
    return BigBirdConfig(**settings)


class _Sparse(torch.nn.Module):
    """One BigBird block-sparse attention over a padded, blocked input with its masks (as BigBirdModel makes them)."""

    def __init__(self) -> None:
        super().__init__()
        from transformers.models.big_bird.modeling_big_bird import BigBirdBlockSparseAttention

        torch.manual_seed(0)
        self.attention = BigBirdBlockSparseAttention(_config(), seed=0)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        from transformers.models.big_bird.modeling_big_bird import BigBirdModel

        blocked, band, from_mask, to_mask = BigBirdModel.create_masks_for_block_sparse_attn(attention_mask.float(), 4)
        return self.attention(hidden_states, band, from_mask, to_mask, blocked, blocked)[0]


def _sparse_inputs(length: int, seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    mask = torch.ones(2, length, dtype=torch.long)
    mask[1, -6:] = 0  # a padded row: masked keys, and masked queries whose output is zeroed
    mask[1, 1] = 0
    return {"hidden_states": torch.randn(2, length, 16, generator=generator), "attention_mask": mask}


def _sparse() -> tuple[torch.nn.Module, dict[str, Any]]:
    return _Sparse().eval(), _sparse_inputs(48, 0)


def _full() -> tuple[torch.nn.Module, dict[str, Any]]:
    from transformers import BigBirdModel

    torch.manual_seed(0)
    model = BigBirdModel(_config(attention_type="original_full")).eval()
    generator = torch.Generator().manual_seed(1)
    return model, {"input_ids": torch.randint(3, 50, (2, 48), generator=generator)}


bigbird_block_sparse_dense = MethodPatch(
    RuleMeta(
        id="patch/bigbird-block-sparse-dense",
        why="BigBird's block-sparse attention builds its random-block table with numpy from the trace's length and "
        "slices blocks by the sample's block count: ONNX Runtime fails at 133 tokens in a Reshape after the model "
        "exported at 128; in eval that table is all zeros (every random block is key block 0), so the attention "
        "is one dense softmax whose per-key log(count) and masks reproduce the eager's weights at every length",
        upstream="transformers==5.24.0 models/big_bird/modeling_big_bird.py "
        "BigBirdBlockSparseAttention.bigbird_block_sparse_attention",
        models=("big_bird",),
        examples=(
            Match(
                _sparse,
                "12 blocks of 4, a row with masked keys and queries, then 17 blocks",
                other_inputs=lambda: _sparse_inputs(68, 1),
            ),
            Match(
                lambda: (_Sparse().eval(), _sparse_inputs(40, 2)),
                "10 blocks of 4 (past the 36-token switch), then 11 blocks",
                other_inputs=lambda: _sparse_inputs(44, 3),
            ),
            NoMatch(
                _full,
                "BigBird with attention_type='original_full'",
                reason="full attention has no block-sparse module to patch",
                applies=False,
            ),
        ),
    ),
    target="transformers.models.big_bird.modeling_big_bird.BigBirdBlockSparseAttention.forward",
    replacement=forward,
)
