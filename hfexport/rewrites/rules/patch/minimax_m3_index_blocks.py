"""MiniMax-M3's block-sparse indexer: whole key blocks for every length, with one padded block more.

The indexer max-pools key scores over blocks of `index_block_size` keys. It pads the keys to whole blocks only
`if pad:` (a guard on the sample's length), keeps `min(index_topk_blocks, num_key_blocks)` blocks with Python's
`min` (another guard), and both it and `build_block_mask` view or slice an axis of `ceil(keys / block)`
blocks: at the 8-token sample that is one block, and torch.export's contiguity metadata guards on a size of 1
(`Eq(ceil(L/8), 1)`). The prefill then accepted 8 tokens at most (`input_ids.size()[1] <= 8`).

Here the keys always get at least one padded key (`keys // block + 1` blocks, as `patch/longt5-pad-blocks`
does): the pad is never 0 and the block axis is 2 at the sample. The extra block holds padded keys only:
its score is -inf, so top-k ranks it after every real block and the indexer tags it `-1` like any empty slot
(one more `-1` column when there are fewer blocks than `index_topk_blocks`), and the mask keeps no key of it
(its keys are cut off by `[..., :key_length]`). The number of blocks kept is `torch.sym_min`, symbolic.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hfexport.rewrites.examples import Built, Match, NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, MethodPatch
from hfexport.rewrites.rule import RuleMeta

_MODULE = "transformers.models.minimax_m3_vl.modeling_minimax_m3_vl"


def _index_blocks(
    self: Any,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    cache: Any,
    position_ids: torch.Tensor,
) -> torch.Tensor:
    """`MiniMaxM3VLIndexer.forward` (`self` is the indexer), changed where marked."""
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import apply_rotary_pos_emb

    batch, q_len, _ = hidden_states.shape
    idx_q = self.q_proj(hidden_states).view(batch, q_len, -1, self.head_dim)
    idx_q = self.q_norm(idx_q).transpose(1, 2)  # [B, H_idx, Sq, D]
    idx_k = self.k_proj(hidden_states).view(batch, q_len, 1, self.head_dim)
    idx_k = self.k_norm(idx_k).transpose(1, 2)  # [B, 1, Sq, D]
    cos, sin = position_embeddings
    idx_q, idx_k = apply_rotary_pos_emb(idx_q, idx_k, cos[..., : self.head_dim], sin[..., : self.head_dim])

    if cache is not None:
        idx_k = cache.layers[self.layer_idx].update_index(idx_k)

    k_len = idx_k.shape[2]
    # Changed: at least one padded key, so the pad is never 0 and there are two blocks at least.
    num_key_blocks = k_len // self.block_size + 1
    pad = num_key_blocks * self.block_size - k_len

    scores = torch.matmul(idx_q.float(), idx_k.float().transpose(-1, -2))
    k_positions = torch.arange(k_len, device=idx_q.device)
    token_future = k_positions[None, None, None, :] > position_ids[:, None, :, None]  # [B, 1, S_q, S_k]
    scores = scores.masked_fill(token_future, float("-inf"))
    scores = F.pad(scores, (0, pad), value=float("-inf"))  # changed: unconditional
    scores = scores.view(batch, self.num_heads, q_len, num_key_blocks, self.block_size)
    block_scores = scores.amax(dim=-1)  # -> [B, H_idx, S_q, num_key_blocks]

    q_block = position_ids // self.block_size  # [B, S_q]

    if self.local_blocks > 0:
        local = torch.arange(self.local_blocks, device=idx_q.device)
        local_idx = (q_block[..., None] - local.view(1, 1, -1)).clamp(min=0)  # [B, S_q, local]
        local_idx = local_idx.unsqueeze(1).expand(-1, self.num_heads, -1, -1)  # [B, H_idx, S_q, local]
        block_scores.scatter_(-1, local_idx, float("inf"))

    topk = torch.sym_min(self.topk_blocks, num_key_blocks)  # changed: symbolic, not Python's min
    topk_scores, topk_indices = block_scores.topk(topk, dim=-1)  # [B, H_idx, S_q, topk]
    return topk_indices.masked_fill(topk_scores == float("-inf"), -1)


def _block_mask(
    self: Any,
    block_indices: torch.Tensor,
    attention_mask: torch.Tensor | None,
    key_length: int,
    dtype: torch.dtype,
    device: torch.device,
    position_ids: torch.Tensor,
) -> torch.Tensor:
    """`MiniMaxM3VLIndexer.build_block_mask` (`self` is the indexer), changed where marked."""
    batch, n_idx_heads, q_len, _ = block_indices.shape
    num_key_blocks = key_length // self.block_size + 1  # changed: the indexer's blocks, the padded one included

    safe = block_indices.masked_fill(block_indices < 0, num_key_blocks)
    bias = block_indices.new_full((batch, n_idx_heads, q_len, num_key_blocks + 1), float("-inf"), dtype=dtype)
    bias.scatter_(-1, safe, 0.0)
    bias = bias[..., :num_key_blocks]

    block_keep = (bias == 0.0).repeat_interleave(self.block_size, dim=-1)[..., :key_length]
    block_keep = block_keep.repeat_interleave(self.config.num_attention_heads // n_idx_heads, dim=1)

    if attention_mask is not None:
        padding_mask = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        keep = block_keep & padding_mask
    else:
        k_positions = torch.arange(key_length, device=device)
        token_future = k_positions[None, None, None, :] > position_ids[:, None, :, None]  # [B, 1, S_q, S_k]
        keep = block_keep & ~token_future
    min_dtype = torch.finfo(dtype).min
    return torch.zeros(keep.shape, dtype=dtype, device=device).masked_fill(~keep, min_dtype)


def attention_forward(
    original: Any,
    self: Any,
    hidden_states: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None,
    cache: Any = None,
    **kwargs: Any,
) -> Any:
    """`MiniMaxM3VLAttention.forward` with the indexer's two steps replaced by `_index_blocks`/`_block_mask`."""
    from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as m

    if self.indexer is None:
        return NOT_APPLICABLE  # a dense layer: nothing to change
    if cache is None:
        cache = kwargs.pop("past_key_values", None)  # the original's deprecated name
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)

    query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

    cos, sin = position_embeddings
    query_states, key_states = m.apply_rotary_pos_emb(query_states, key_states, cos, sin)

    if cache is not None:
        key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)

    attention_interface = m.ALL_ATTENTION_FUNCTIONS.get_interface(
        self.config._attn_implementation, m.eager_attention_forward
    )
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        position_ids = torch.arange(
            key_states.shape[2] - query_states.shape[2], key_states.shape[2], device=query_states.device
        )
    position_ids = (position_ids if position_ids.ndim > 1 else position_ids.unsqueeze(0)).expand(
        query_states.shape[0], -1
    )
    block_indices = _index_blocks(self.indexer, hidden_states, position_embeddings, cache, position_ids)  # changed
    if self.config._attn_implementation in ("eager", "sdpa"):
        attention_mask = _block_mask(  # changed
            self.indexer,
            block_indices,
            attention_mask,
            key_states.shape[2],
            query_states.dtype,
            query_states.device,
            position_ids,
        )

    attn_output, attn_weights = attention_interface(
        self,
        query_states,
        key_states,
        value_states,
        attention_mask,
        dropout=0.0 if not self.training else self.attention_dropout,
        scaling=self.scaling,
        block_indices=block_indices,
        **kwargs,
    )
    attn_output = attn_output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(attn_output), attn_weights


# OpenVINO: the blocks' symbolic min and floor divisions, and the left-padded row's fully masked rows.
_NEEDS = ("openvino/sym-min-max-to-floordiv", "openvino/exact-int-floor-divide", "openvino/sdpa-fully-masked-rows")


def _minimax(tokens: int, sparse: bool = True) -> Built:
    from transformers import MiniMaxM3VLTextConfig, MiniMaxM3VLTextModel

    torch.manual_seed(0)
    config = MiniMaxM3VLTextConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        index_n_heads=2,
        index_head_dim=16,
        index_block_size=4,
        index_topk_blocks=3,
        index_local_blocks=1,
        layer_types=["minimax_m3_sparse" if sparse else "full_attention"],
        mlp_layer_types=["dense"],
    )
    model = MiniMaxM3VLTextModel(config).eval()
    generator = torch.Generator().manual_seed(tokens)
    ids = torch.randint(3, 64, (2, tokens), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return model, {"input_ids": ids, "attention_mask": mask, "use_cache": False}


def _grown(tokens: int, batch: int = 2) -> dict[str, Any]:
    ids = torch.randint(3, 64, (batch, tokens), generator=torch.Generator().manual_seed(100 + tokens))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}


minimax_m3_index_blocks = MethodPatch(
    RuleMeta(
        id="patch/minimax-m3-index-blocks",
        why="MiniMax-M3's prefill exported for the sample's length only (`input_ids.size()[1] <= 8`): its "
        "block-sparse indexer pads keys to whole blocks only `if pad:`, keeps `min(topk_blocks, blocks)` blocks "
        "with Python's min, and its scores and mask have an axis of ceil(keys / block) blocks, 1 at the sample, "
        "on which torch's contiguity metadata guards; one padded block more and `torch.sym_min` keep the length "
        "symbolic, with the same attention mask",
        upstream="transformers==5.24.0 models/minimax_m3_vl/modeling_minimax_m3_vl.py MiniMaxM3VLIndexer (`if pad:`, "
        "builtin min); torch 2.13 check_contiguous_sizes_strides guard_or_false(x == 1) "
        "(https://github.com/pytorch/pytorch/pull/185084)",
        models=("minimax_m3_vl",),
        examples=(
            Match(
                lambda: _minimax(4),
                "one block of 4 keys at the sample, left padding, then 11 tokens (three blocks, one partial)",
                other_inputs=lambda: _grown(11),
                needs=_NEEDS,
            ),
            Match(
                lambda: _minimax(14),
                "four blocks (more than index_topk_blocks), then 5 tokens",
                other_inputs=lambda: _grown(5, batch=3),
                needs=_NEEDS,
                known_failure={
                    "executorch": "ExecuTorch plans the batch axis at the sample's 2 (the bound the program records), "
                    "so the example's other inputs of batch 3 are refused: a coverage gap (#17)"
                },
            ),
            NoMatch(
                lambda: _minimax(8, sparse=False),
                "MiniMax-M3 with a full-attention layer",
                reason="the replacement declines an attention layer without an indexer",
            ),
        ),
    ),
    target=f"{_MODULE}.MiniMaxM3VLAttention.forward",
    replacement=attention_forward,
)
