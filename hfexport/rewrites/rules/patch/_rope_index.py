"""What the multimodal rope-index patches return, as upstream's `get_rope_index` does (`patch/mrope-index-tensor`,
`patch/hunyuan-vl-rope-index-tensor`)."""

from __future__ import annotations

import torch


def masked_positions_and_deltas(
    positions: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`get_rope_index`'s return: the `[axes, batch, length]` positions zeroed where `valid` is False, in `dtype`,
    and each row's rope delta (its highest valid position + 1 less its valid token count), `[batch, 1]`."""
    positions = torch.where(valid, positions, 0)
    highest = torch.where(valid, positions, torch.iinfo(torch.long).min).amax(dim=(0, 2))
    deltas = (highest + 1 - valid.long().sum(1)).unsqueeze(1)
    return positions.to(dtype), deltas
