"""CPM-Ant: its left-padding mask is built from a Python list of the sequence length."""

from __future__ import annotations

from typing import Any

import torch

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, MethodPatch
from hfexport.rewrites.rule import RuleMeta


def prepare_attention_mask(
    original: Any,
    self: torch.nn.Module,
    input_ids: torch.Tensor,
    span: torch.Tensor,
    context: torch.Tensor,
    length: torch.Tensor,
) -> torch.Tensor:
    batch, seqlen = input_ids.size(0), input_ids.size(1)
    if not isinstance(seqlen, torch.SymInt):
        return NOT_APPLICABLE  # a concrete length: the original's list of it is exact and traceable
    device = input_ids.device
    directional_mask_2d = torch.arange(seqlen, device=device) <= torch.arange(seqlen, device=device).view(-1, 1)
    attention_mask = context[:, None, :] | (
        context[:, :, None].logical_not() & directional_mask_2d.view(1, seqlen, seqlen)
    )
    attention_mask = attention_mask & (span[:, None, :] == span[:, :, None])
    # `torch.tensor(list(range(n))[::-1])` needs a concrete n; arange counts down the same int64 values.
    countdown = torch.arange(seqlen - self.prompt_length - 1, -1, -1, device=device)
    mask_1d = countdown[None, :].repeat(batch, 1) < length[:, None]
    mask_1d = torch.cat((torch.ones(batch, self.prompt_length, device=device).bool(), mask_1d), dim=1)
    return mask_1d.view(batch, seqlen, 1) & mask_1d.view(batch, 1, seqlen) & attention_mask


def _cpmant(padded: bool, length: int = 7) -> tuple[torch.nn.Module, dict[str, Any]]:
    from transformers import CpmAntConfig, CpmAntModel

    torch.manual_seed(0)
    config = CpmAntConfig(
        vocab_size=64,
        hidden_size=16,
        num_attention_heads=2,
        dim_head=8,
        dim_ff=32,
        num_hidden_layers=1,
        prompt_length=8,
        prompt_types=8,
        segment_types=8,
    )
    ids = torch.randint(1, 64, (2, length), generator=torch.Generator().manual_seed(length))
    if padded:  # CPM-Ant derives its padding mask from id 0, not from an attention mask
        ids[0, :3] = 0
    return CpmAntModel(config).eval(), {"input_ids": ids, "use_cache": False}


cpmant_mask_arange = MethodPatch(
    RuleMeta(
        id="patch/cpmant-mask-arange",
        why="CPM-Ant exports with the sequence length baked in: its mask builds "
        "`torch.tensor(list(range(seqlen - prompt_length))[::-1])` from a Python list",
        upstream="transformers==5.24.0 models/cpmant/modeling_cpmant.py CpmAntModel._prepare_attention_mask",
        models=("cpmant",),
        examples=(
            Match(
                lambda: _cpmant(padded=False),
                "no padding, then a longer padded input",
                other_inputs=lambda: {
                    "input_ids": torch.cat([torch.zeros(2, 2, dtype=torch.long), torch.randint(1, 64, (2, 9))], 1),
                    "use_cache": False,
                },
            ),
            Match(
                lambda: _cpmant(padded=True),
                "a left-padded row, then a shorter input without padding",
                other_inputs=lambda: _cpmant(padded=False, length=4)[1],
            ),
            NoMatch(
                lambda: _cpmant(padded=True),
                "a left-padded row, exported static",
                reason="the replacement declines a concrete sequence length: the original's list is exact there",
            ),
        ),
    ),
    target="transformers.models.cpmant.modeling_cpmant.CpmAntModel._prepare_attention_mask",
    replacement=prepare_attention_mask,
)
