"""DeepSeek-V4's compressed sparse attention: the overlapping-window layout without a `windows - 1` axis.

The CSA compressor and its Lightning indexer compress windows of `compress_rate` tokens; each compressed entry
also sees the previous window's rows, laid out with `new_kv[:, 1:, :ratio] = chunk_kv[:, :-1, ...]` under
`if n_windows > 1:`. At the 8-token sample there are two windows: the slice has `n_windows - 1 = 1` rows, and
torch.export's contiguity metadata guards on a size of 1 (`Eq((L // 4) - 1, 1)`), so the program accepted 8
to 11 tokens only (`input_ids.size()[1] <= 11`). The indexer also keeps `min(index_topk, entries)` with
Python's `min`, a guard on the sample's entry count.

Here the previous window's rows come from the windows shifted by one with a padded first window
(`F.pad(x, one window before)[:, :n_windows]`: zeros for the keys, -inf for the gates, what the original
leaves in window 0), so no axis has `n_windows - 1` elements and the `n_windows > 1` branch is gone (with one
window the shift is the padding only, as the original's untouched window 0). Without a cache, the whole
windows are cut from kv padded to one window more instead of viewed from `kv[:, :usable]`, which at a sample
length that is a multiple of the window is as long as kv (a coincidence the contiguity metadata guards on:
`Eq(64*L, 256*(L//4))`). The top-k count is `torch.sym_min`. Values are the original's, bit for bit. The lower
bound stays (at least two windows: 8 tokens), and the cache path (generation) is unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.patch import MethodPatch
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.patch._deepseek_v4 import EXAMPLE_NEEDS, deepseek_v4_example, longer_inputs

_MODULE = "transformers.models.deepseek_v4.modeling_deepseek_v4"


def _overlap(
    chunk_kv: torch.Tensor, chunk_gate: torch.Tensor, head_dim: int, ratio: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `[B, n_win, 2 * ratio, head_dim]` layouts of kv and gate (each in its own dtype, as the original's
    `new_zeros` / `new_full`): the previous window's Ca, then this window's Cb."""
    n_windows = chunk_kv.shape[1]
    # One window of padding before the first (zero kv, -inf gate: softmax weight 0), then drop the last window.
    previous_kv = F.pad(chunk_kv[..., :head_dim], (0, 0, 0, 0, 1, 0))[:, :n_windows]
    previous_gate = F.pad(chunk_gate[..., :head_dim], (0, 0, 0, 0, 1, 0), value=float("-inf"))[:, :n_windows]
    new_kv = torch.cat([previous_kv, chunk_kv[..., head_dim:]], dim=2)
    new_gate = torch.cat([previous_gate, chunk_gate[..., head_dim:]], dim=2)
    return new_kv, new_gate


def _compressed_windows(
    self: torch.nn.Module, hidden_states: torch.Tensor, cache_layer: Any, name: str
) -> torch.Tensor:
    """The compressed windows of the indexer and of the compressor (`name`), which share this code upstream too."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

    batch = hidden_states.shape[0]
    kv = self.kv_proj(hidden_states)
    gate = self.gate_proj(hidden_states)

    ratio = self.compress_rate
    if cache_layer is None:
        # Changed: the whole windows of kv padded by 1 to `ratio` rows (one window more, then dropped), not a
        # view of `kv[:, :usable]`: at a sample length that is a multiple of the window that slice is as long as
        # kv, and torch's contiguity metadata guards on the coincidence (`Eq(64*L, 256*(L//4))`).
        n_windows = kv.shape[1] // ratio
        extra = (n_windows + 1) * ratio - kv.shape[1]
        chunk_kv = F.pad(kv, (0, 0, 0, extra)).view(batch, n_windows + 1, ratio, -1)[:, :n_windows]
        chunk_gate = F.pad(gate, (0, 0, 0, extra)).view(batch, n_windows + 1, ratio, -1)[:, :n_windows]
        first_window_position = 0
    else:
        chunk_kv, chunk_gate, first_window_position = cache_layer.store_compression_weights(name, kv, gate)
        n_windows = chunk_kv.shape[1] // ratio

    if n_windows > 0:  # there were at least `ratio` tokens (the original tests chunk_kv.shape[1] > 0)
        if cache_layer is not None:
            chunk_kv = chunk_kv.view(batch, n_windows, ratio, -1)
            chunk_gate = chunk_gate.view(batch, n_windows, ratio, -1)
        chunk_gate = chunk_gate + self.position_bias

        new_kv, new_gate = _overlap(chunk_kv, chunk_gate, self.head_dim, ratio)  # changed
        if cache_layer is not None:
            prior_kv, prior_gate = cache_layer.update_overlap_state(name, chunk_kv, chunk_gate, self.head_dim)
            if prior_kv is not None:
                new_kv[:, 0, :ratio] = prior_kv.to(new_kv.dtype)
                new_gate[:, 0, :ratio] = prior_gate.to(new_gate.dtype)

        compressed = self.kv_norm((new_kv * new_gate.softmax(dim=2, dtype=torch.float32).to(new_kv.dtype)).sum(dim=2))
        positions = torch.arange(n_windows, device=compressed.device)
        positions = positions * self.compress_rate + first_window_position
        positions = positions.unsqueeze(0).expand(batch, -1)
        cos, sin = self.rotary_emb(compressed, position_ids=positions, layer_type=self.rope_layer_type)
        compressed = apply_rotary_pos_emb(compressed.unsqueeze(1), cos, sin).squeeze(1)
    else:
        compressed = kv.new_zeros((batch, 0, self.head_dim))
    return compressed


def _indexer_forward(
    self: Any,
    hidden_states: torch.Tensor,
    q_residual: torch.Tensor,
    position_ids: torch.Tensor,
    cache: Any,
    layer_idx: int,
) -> torch.Tensor:
    """`DeepseekV4Indexer.forward` (`self` is the indexer), changed where marked."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import apply_rotary_pos_emb

    batch, seq_len, _ = hidden_states.shape
    cache_layer = cache.layers[layer_idx] if cache is not None else None
    compressed = _compressed_windows(self, hidden_states, cache_layer, "indexer")

    compressed_kv = compressed if cache_layer is None else cache_layer.update_compressor_states("indexer", compressed)

    cos_q, sin_q = self.rotary_emb(hidden_states, position_ids=position_ids, layer_type=self.rope_layer_type)
    q = self.q_b_proj(q_residual).view(batch, seq_len, -1, self.head_dim).transpose(1, 2)
    q = apply_rotary_pos_emb(q, cos_q, sin_q).transpose(1, 2)

    index_scores = self.scorer(q, compressed_kv, hidden_states)  # [B, S, T]
    compressed_len = compressed_kv.shape[1]
    top_k = torch.sym_min(self.index_topk, compressed_len)  # changed: symbolic, not Python's min

    if compressed_len > 0:
        causal_threshold = (position_ids + 1) // self.compress_rate  # [B, S]
        entry_indices = torch.arange(compressed_len, device=index_scores.device)
        future_mask = entry_indices.view(1, 1, -1) >= causal_threshold.unsqueeze(-1)  # [B, S, T]
        index_scores = index_scores.masked_fill(future_mask, float("-inf"))
        top_k_indices = index_scores.topk(top_k, dim=-1).indices  # [B, S, k]
        invalid = top_k_indices >= causal_threshold.unsqueeze(-1)
        return torch.where(invalid, torch.full_like(top_k_indices, -1), top_k_indices)

    return index_scores.topk(top_k, dim=-1).indices


def csa_compressor_forward(
    original: Any,
    self: Any,
    hidden_states: torch.Tensor,
    q_residual: torch.Tensor,
    position_ids: torch.Tensor,
    cache: Any = None,
    layer_idx: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`DeepseekV4CSACompressor.forward`, changed where marked."""

    if cache is None:
        cache = kwargs.pop("past_key_values", None)  # the original's deprecated name
    batch, seq_len, _ = hidden_states.shape
    cache_layer = cache.layers[layer_idx] if cache is not None else None
    compressed = _compressed_windows(self, hidden_states, cache_layer, "compressor")

    if cache_layer is not None:
        compressed = cache_layer.update_compressor_states("compressor", compressed)
    compressed_kv = compressed.unsqueeze(1)

    top_k_indices = _indexer_forward(self.indexer, hidden_states, q_residual, position_ids, cache, layer_idx)  # changed
    compressed_len = compressed_kv.shape[2]
    valid = top_k_indices >= 0  # [B, S, k]
    safe_indices = torch.where(valid, top_k_indices, torch.full_like(top_k_indices, compressed_len))
    block_bias = compressed_kv.new_full((batch, 1, seq_len, compressed_len + 1), float("-inf"))
    block_bias.scatter_(-1, safe_indices.unsqueeze(1), 0.0)
    return compressed_kv, block_bias[..., :compressed_len]


deepseek_v4_overlap_windows = MethodPatch(
    RuleMeta(
        id="patch/deepseek-v4-overlap-windows",
        why="DeepSeek-V4 exported for 8 to 11 tokens only (`input_ids.size()[1] <= 11`): its compressed sparse "
        "attention lays out overlapping windows with a `n_windows - 1` slice, 1 at the sample, on which torch's "
        "contiguity metadata guards, and keeps `min(index_topk, entries)` with Python's min; a padded shift of "
        "the windows and `torch.sym_min` keep the length symbolic with the same values",
        upstream="transformers==5.24.0 models/deepseek_v4/modeling_deepseek_v4.py DeepseekV4CSACompressor / "
        "DeepseekV4Indexer (`if n_windows > 1:`, builtin min); torch 2.13 check_contiguous_sizes_strides "
        "guard_or_false(x == 1) (https://github.com/pytorch/pytorch/pull/185084)",
        models=("deepseek_v4",),
        examples=(
            Match(
                lambda: deepseek_v4_example(8),
                "two windows at the sample (a one-row overlap), then 13 tokens",
                atol=1e-5,
                other_inputs=lambda: longer_inputs(13, batch=3),
                needs=EXAMPLE_NEEDS,
                known_failure={
                    "executorch": "to_edge refuses the DeepSeek-V4 program (SpecViolationError in the edge verifier): "
                    "an ExecuTorch coverage gap of the architecture (#17)"
                },
            ),
            Match(
                lambda: deepseek_v4_example(10),
                "two windows and a partial one, then 22 tokens",
                atol=1e-5,
                other_inputs=lambda: longer_inputs(22),
                needs=EXAMPLE_NEEDS,
                known_failure={"executorch": "as Match 0 on ExecuTorch (edge verifier)"},
            ),
            NoMatch(
                lambda: deepseek_v4_example(8, layer="sliding_attention"),
                "DeepSeek-V4 with a sliding-attention layer (no CSA compressor)",
                reason="the replacement declines no call: it rewrites every CSA compressor forward, so only a "
                "DeepSeek-V4 without CSA layers, where the patch has nothing to install on, goes without it",
                applies=False,
            ),
        ),
    ),
    target=f"{_MODULE}.DeepseekV4CSACompressor.forward",
    replacement=csa_compressor_forward,
)
