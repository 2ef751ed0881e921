"""Qwen4-Exp's QSA indexer: every (batch, query) row at once, instead of a Python loop over them.

The indexer picks, for each query, the key tokens its attention may see: the visible keys (the attention mask's
row) are cut, in key order, into blocks of `compress_ratio` tokens; each complete block's keys are mean-pooled,
normed and rotated at the block's first position; the `token_budget // compress_ratio` blocks with the largest
score (sum over the heads of relu(q . block key) / sqrt(head_dim)) are kept, and so are the visible keys past the
last complete block (the tail). The original loops in Python over `range(batch_size)` and `range(seq_length)`,
with a `nonzero` over each row's visible keys and `if num_complete_blocks > 0` on its length: the trace guards on
the data-dependent count ((u0//4) > 0) and the loops bake the sample's batch and length into the program.

Here the rank of each visible key among the row's visible keys (a cumulative sum over the mask) places it in its
block; a scatter of the key positions by rank gives, for every row, the positions of its first `K // ratio + 1`
blocks (`K` the key length: one block more than can be complete, so the block axis is never empty), gathered
from the keys, pooled, normed and rotated as in the original (float mean of the block, cast back, `k_layernorm`,
`apply_rotary_pos_emb` at the block's first position). Blocks past the row's complete ones score -inf. A block is
kept when fewer than `block_topk` blocks outrank it (a larger score, or an equal score at a smaller index): the
top `min(block_topk, complete blocks)` blocks, with ties between exactly equal scores going to the earlier block,
as ONNX TopK orders them (eager `topk` on CPU leaves the order of equal scores to std::nth_element or
std::partial_sort, which no vectorised form reproduces: see the rule's `why`). The mask is
the kept blocks' keys and the tail, for every row; the length stays symbolic and no value is read back.
"""

from __future__ import annotations

import inspect
import math
import sys
from typing import Any

import torch

from hfexport.rewrites.examples import Built, Match, NoMatch
from hfexport.rewrites.kinds.patch import MethodPatch
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules._coverage_gaps import XNNPACK_RESHAPE

_PARAMETERS = ["hidden_states", "position_embeddings", "attention_mask", "cache"]
_ATTRIBUTES = ("token_budget", "compress_ratio", "block_topk", "index_head_dim", "index_n_heads", "index_kv_heads")


def is_qsa_indexer(module: torch.nn.Module) -> bool:
    """A QSA indexer by structure: its sizes, `index_qk_proj`, `q_layernorm`/`k_layernorm`, the forward's parameters
    and an `apply_rotary_pos_emb` next to its class."""
    if not all(isinstance(getattr(module, a, None), int) for a in _ATTRIBUTES):
        return False
    if not isinstance(getattr(module, "index_qk_proj", None), torch.nn.Linear):
        return False
    if not all(isinstance(getattr(module, a, None), torch.nn.Module) for a in ("q_layernorm", "k_layernorm")):
        return False
    if module.block_topk != module.token_budget // module.compress_ratio or module.compress_ratio < 1:
        return False
    if not callable(getattr(sys.modules.get(type(module).__module__), "apply_rotary_pos_emb", None)):
        return False
    try:
        parameters = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return False
    return parameters == _PARAMETERS


def qsa_indexer_forward(
    original: Any,
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor,
    cache: Any = None,
) -> torch.Tensor:
    """The indexer's forward for all rows at once (see the module doc); the projections as in the original."""
    apply_rotary_pos_emb = sys.modules[type(self).__module__].apply_rotary_pos_emb
    batch_size, seq_length, _ = hidden_states.shape
    hidden_shape = (batch_size, seq_length, -1, self.index_head_dim)
    full_cos, full_sin = position_embeddings
    current_cos, current_sin = full_cos[:, -seq_length:, :], full_sin[:, -seq_length:, :]

    qk = self.index_qk_proj(hidden_states)
    q, token_k = torch.split(
        qk, [self.index_n_heads * self.index_head_dim, self.index_kv_heads * self.index_head_dim], dim=-1
    )
    q, raw_keys = q.reshape(*hidden_shape), token_k.reshape(*hidden_shape).squeeze(2)
    q = self.q_layernorm(q)
    q = apply_rotary_pos_emb(q, cos=current_cos, sin=current_sin, unsqueeze_dim=2)

    if cache is not None:
        raw_keys = cache.update_indexer(raw_keys, self.layer_idx)

    visible = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
    visible = visible[:, 0]  # [B, Q, K]
    ratio, device = self.compress_ratio, hidden_states.device
    kv_length = visible.shape[-1]
    num_blocks = kv_length // ratio + 1  # one more than can be complete: never 0
    slots = num_blocks * ratio

    # Each visible key's rank among its row's visible keys, and the rank -> key position table of every row.
    rank = visible.long().cumsum(-1) - 1  # [B, Q, K]
    complete = visible.sum(-1, keepdim=True) // ratio  # [B, Q, 1]: the row's complete blocks
    keys_at = torch.arange(kv_length, device=device).expand_as(rank)
    where = torch.where(visible, rank, slots)  # invisible keys land in a dropped slot
    position = torch.zeros((*rank.shape[:-1], slots + 1), dtype=torch.long, device=device)
    position = position.scatter(-1, where, keys_at)[..., :slots]  # [B, Q, slots]; unfilled slots read key 0

    # The blocks' keys as in the original: pooled in float, cast back, normed, rotated at the block's first key.
    batch = torch.arange(batch_size, device=device).view(-1, 1, 1)
    groups = raw_keys[batch, position]  # [B, Q, slots, D]
    groups = groups.view(batch_size, seq_length, num_blocks, ratio, self.index_head_dim)
    pooled = self.k_layernorm(groups.float().mean(dim=3).to(raw_keys.dtype))  # [B, Q, N, D]
    starts = position[..., ::ratio]  # [B, Q, N]
    cos, sin = full_cos[batch, starts], full_sin[batch, starts]  # [B, Q, N, rotary]
    block_keys = apply_rotary_pos_emb(pooled.unsqueeze(-2), cos=cos, sin=sin, unsqueeze_dim=-2).squeeze(-2)

    scores = torch.matmul(q.float().unsqueeze(2), block_keys.float().unsqueeze(-1)).squeeze(-1)  # [B, Q, N, H]
    scores = torch.relu(scores).sum(dim=-1) / math.sqrt(self.index_head_dim)
    block = torch.arange(num_blocks, device=device)
    scores = scores.masked_fill(block >= complete, float("-inf"))

    # A block is kept when fewer than block_topk blocks outrank it (a larger score, or the same at a smaller index).
    above = scores.unsqueeze(-2) > scores.unsqueeze(-1)  # [B, Q, j, i]: block i scores above block j
    tied_before = (scores.unsqueeze(-2) == scores.unsqueeze(-1)) & (block.view(1, -1) < block.view(-1, 1))
    outranked_by = (above | tied_before).sum(-1)  # [B, Q, N]
    kept = (outranked_by < self.block_topk) & (block < complete)

    key_block = torch.div(rank.clamp(min=0), ratio, rounding_mode="floor")
    selected = visible & (kept.gather(-1, key_block.clamp(max=num_blocks - 1)) | (key_block >= complete))
    return selected.unsqueeze(1)


def _qwen4(tokens: int, left_pad: int = 0, budget: int = 8, batch: int = 2, layer: str = "indexed_attention") -> Built:
    from transformers import Qwen4ExpTextConfig, Qwen4ExpTextModel

    torch.manual_seed(0)
    config = Qwen4ExpTextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        layer_types=[layer],
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=16,
        indexer_budget=budget,
        indexer_compress_ratio=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=8,
    )
    model = Qwen4ExpTextModel(config).eval()
    ids = torch.randint(0, 64, (batch, tokens), generator=torch.Generator().manual_seed(tokens))
    mask = torch.ones_like(ids)
    mask[-1, :left_pad] = 0
    return model, {"input_ids": ids, "attention_mask": mask, "use_cache": False}


def _other(tokens: int, batch: int) -> dict[str, Any]:
    _, inputs = _qwen4(tokens, left_pad=3, batch=batch)
    return inputs


# The example's MoE layer (transformers' grouped_mm experts): its fallback op has no ONNX function, and its histc is
# refused by to_edge and by OpenVINO's converter.
# OpenVINO: the left-padded row's fully masked attention rows and the blocks' integer floor divisions.
_NEEDS = (
    "aten/grouped-mm-fallback",
    "patch/moe-batched-experts",
    "openvino/sdpa-fully-masked-rows",
    "openvino/exact-int-floor-divide",
)

qsa_indexer_vectorized = MethodPatch(
    RuleMeta(
        id="patch/qsa-indexer-vectorized",
        why="Qwen4-Exp does not export: its QSA sparse-attention indexer loops in Python over the batch and the "
        "queries with a nonzero over each row's visible keys and `if num_complete_blocks > 0` (a guard on a "
        "data-dependent count, (u0//4) > 0), which would also bake in the sample's batch and length; here every "
        "row is computed at once (the visible keys' ranks by cumsum, blocks gathered by rank, pooled, normed and "
        "rotated as in the original, blocks kept by counting those that outrank them), the same mask with the "
        "length symbolic. Ties between exactly equal block scores (relu makes many blocks score 0) go to the "
        "earlier block, ONNX TopK's order; eager's CPU topk leaves their order to std::nth_element, so on the "
        "corpus models the logits differ from eager at 73 and 138 tokens (max 0.0114, qwen4_exp_text) where a "
        "row's cut falls between tied blocks, and equal the original run with a stable top-k bit for bit (max "
        "diff 0.0 at 13, 73, 138 tokens and batch 3)",
        upstream="transformers==5.24.0 models/qwen4_exp/modeling_qwen4_exp.py Qwen4ExpTextQSAIndexer.forward "
        "(`for batch_idx in range(batch_size): for query_idx in range(seq_length):`)",
        models=("qwen4_exp", "qwen4_exp_text"),
        examples=(
            Match(
                lambda: _qwen4(8, left_pad=3),
                "8 tokens, a row left-padded by 3 (fewer visible keys than a block in its first rows), then 13 "
                "tokens in a batch of 3",
                other_inputs=lambda: _other(13, 3),
                needs=_NEEDS,
                known_failure={"executorch": XNNPACK_RESHAPE},
            ),
            Match(
                lambda: _qwen4(23, left_pad=2, budget=8),
                "23 tokens: more complete blocks than the 2 kept (budget 8 / ratio 4), and a partial tail",
                needs=_NEEDS,
            ),
            NoMatch(
                lambda: _qwen4(6, layer="linear_attention"),
                "Qwen4-Exp with a linear-attention layer only (no indexer)",
                reason="the predicate matches only QSA indexer modules and the replacement declines nothing a trace "
                "reaches (every row is computed), so the rule is not installed on a model without an indexer",
                applies=False,
            ),
        ),
    ),
    target=is_qsa_indexer,
    method="forward",
    replacement=qsa_indexer_forward,
)
