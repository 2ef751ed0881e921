"""Multimodal rotary positions (M-RoPE) that `generate` computes with model code before the first forward.

Qwen2-VL-style models (Qwen2/2.5/3-VL, Qwen3.5, GLM-4V, GLM-4.6V, PaddleOCR-VL, ERNIE-4.5-VL...) override
`_prepare_position_ids_for_generation`: for the prompt, text tokens advance one position on every rotary
axis, and each image or video block gets a grid of (temporal, height, width) positions from its layout;
later tokens continue from the block's end, and each decode step's position is the text position plus a
per-row delta (`rope_deltas`). That is a Python loop over the prompt, not a graph, so it is not exported.

With the image layout baked into the graphs (`LayoutSpecialised`), every block of a prompt has the layout
of the matching block in the export sample, so its positions are fixed, either relative to where the block
starts or absolute. They are read off the positions the model itself computed for the sample and for the
sample with text added in front (`derive`), checked by recomputing both, and replayed by the runtime on a
new prompt (`apply`): no per-model code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from hfexport.core.errors import InputError


@dataclass
class PositionBlock:
    """One modality block of the sample: its token type and length, and its positions relative to its start."""

    token_type: int
    # [rotary rows][length]: position minus the running position at the block's first token.
    offsets: list[list[int]]
    # How far the running position moves past the block; None when no text followed it in the sample.
    advance: int | None
    # [axes][length]: which offsets are positions themselves, not relative to the block's start (HunYuan-VL's
    # grid); empty when all are relative.
    absolute: list[list[bool]] = field(default_factory=list)


@dataclass
class MultimodalPositions:
    """How to build the prefill's multimodal positions and the decode steps' deltas (see the module docstring)."""

    # The per-token input that marks modality tokens (non-zero; e.g. `mm_token_type_ids`), or None to use
    # `token_ids` (the config's image/video token ids) on input_ids.
    type_key: str | None
    token_ids: list[int]
    # The prefill positions start with a row of plain text positions (`[1 + rotary rows, batch, length]`).
    text_row: bool
    # Modality blocks in prompt order over the whole batch (row by row), as the layout's grids are consumed.
    blocks: list[PositionBlock] = field(default_factory=list)
    # Rows of a decode step's 3-D position_ids (`[rows, batch, 1]`), or None when they are 2-D.
    decode_rows: int | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MultimodalPositions:
        return cls(**{**data, "blocks": [PositionBlock(**b) for b in data["blocks"]]})


def text_positions(mask: torch.Tensor) -> torch.Tensor:
    """Plain positions of a 2-D mask, as generate builds them (padding gets position 1)."""
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


def _token_types(ids: torch.Tensor, types: torch.Tensor | None, token_ids: list[int]) -> torch.Tensor:
    if types is not None:
        return torch.as_tensor(types).long()
    marked = torch.zeros_like(ids, dtype=torch.long)
    for index, token in enumerate(token_ids, start=1):
        marked = torch.where(ids == token, torch.full_like(marked, index), marked)
    return marked


def _runs(kinds: list[int]) -> list[tuple[int, int, int]]:
    """(kind, start, end) of each maximal run of equal values."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(kinds) + 1):
        if i == len(kinds) or kinds[i] != kinds[start]:
            runs.append((kinds[start], start, i))
            start = i
    return runs


def _blocks(
    position_ids: torch.Tensor, mask: torch.Tensor, kinds: torch.Tensor
) -> tuple[bool, list[tuple[int, int, torch.Tensor, int | None]]] | None:
    """(text row?, [(kind, running position at its start, its positions, advance)] per block in prompt order),
    or None when text tokens do not advance one position on every axis."""
    text = text_positions(mask)
    valid = mask.bool()
    text_row = position_ids.shape[0] == 4 and bool((position_ids[0][valid] == text[valid]).all())
    rotary = position_ids[1:] if text_row else position_ids
    blocks: list[tuple[int, int, torch.Tensor, int | None]] = []
    for row in range(mask.shape[0]):
        where = valid[row].nonzero().flatten()
        grid = rotary[:, row, where]
        current = 0
        for kind, start, end in _runs(kinds[row, where].tolist()):
            if kind == 0:
                if not bool((grid[:, start:end] == torch.arange(current, current + end - start)).all()):
                    return None
                current += end - start
                continue
            advance = int(grid[0, end]) - current if end < len(where) else None
            blocks.append((int(kind), current, grid[:, start:end], advance))
            if advance is None:
                break
            current += advance
    return text_row, blocks


def derive(
    position_ids: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    types: torch.Tensor | None,
    type_key: str | None,
    token_ids: list[int],
    decode_position_ids: Any,
    shifted: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
) -> MultimodalPositions | None:
    """The template of a sample's 3-D prefill positions, or None when they do not follow the block pattern.

    `shifted` is the model's own positions for the same prompt with one more text token in front of each row
    (`(position_ids, input_ids, attention_mask, types)`): a block position that moves with it is relative to
    the block's start (Qwen2-VL's grids), one that stays is absolute (HunYuan-VL's grid). Without it every
    position is taken as relative. Either way the template must rebuild the prompts it was read from.
    """
    if position_ids.ndim != 3 or input_ids.ndim != 2:
        return None
    mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask.long()
    if mask.ndim != 2:
        return None
    found = _blocks(position_ids, mask, _token_types(input_ids, types, token_ids))
    if found is None:
        return None
    text_row, sample_blocks = found
    absolute = [torch.zeros_like(block[2], dtype=torch.bool) for block in sample_blocks]
    if shifted is not None:
        moved_ids, moved_mask, moved_types = shifted[1], shifted[2].long(), shifted[3]
        moved = _blocks(shifted[0], moved_mask, _token_types(moved_ids, moved_types, token_ids))
        if moved is None or moved[0] != text_row or len(moved[1]) != len(sample_blocks):
            return None
        for index, ((_, _, before, _), (_, _, after, _)) in enumerate(zip(sample_blocks, moved[1], strict=True)):
            if before.shape != after.shape:
                return None
            # Per axis and token: a position that stays is absolute (HunYuan-VL's grid), one that moves with the
            # block is relative (Qwen2-VL's grids, HunYuan-VL's start and end tokens); anything else is no pattern.
            absolute[index] = after == before
            if not bool(((after == before) | (after == before + 1)).all()):
                return None
    blocks = [
        PositionBlock(
            kind, torch.where(flags, values, values - current).tolist(), advance, flags.tolist() if flags.any() else []
        )
        for flags, (kind, current, values, advance) in zip(absolute, sample_blocks, strict=True)
    ]
    decode_rows = None
    if isinstance(decode_position_ids, torch.Tensor) and decode_position_ids.ndim == 3:
        decode_rows = int(decode_position_ids.shape[0])
    template = MultimodalPositions(type_key, list(token_ids), text_row, blocks, decode_rows)
    prompts = [(position_ids, input_ids, mask, types)] + ([shifted] if shifted is not None else [])
    for expected, ids, valid_mask, kinds in prompts:
        try:
            rebuilt, _ = apply(template, ids, valid_mask.long(), kinds)
        except InputError:
            return None
        valid = valid_mask.bool()
        if rebuilt.shape != expected.shape or not bool((rebuilt[:, valid] == expected[:, valid]).all()):
            return None
    return template


def apply(
    template: MultimodalPositions, input_ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(prefill position_ids, per-row delta `[batch, 1]`) of a prompt, replaying the template's blocks."""
    kinds = _token_types(input_ids, types, template.token_ids)
    rows = len(template.blocks[0].offsets) if template.blocks else 3
    batch, length = input_ids.shape
    rotary = torch.zeros((rows, batch, length), dtype=torch.long)
    deltas = torch.zeros((batch, 1), dtype=torch.long)
    blocks = iter(template.blocks)
    for row in range(batch):
        where = mask[row].bool().nonzero().flatten()
        current = 0
        positions: list[torch.Tensor] = []
        runs = _runs(kinds[row, where].tolist())
        for index, (kind, start, end) in enumerate(runs):
            if kind == 0:
                positions.append(torch.arange(current, current + end - start).expand(rows, -1))
                current += end - start
                continue
            block = next(blocks, None)
            if block is None or block.token_type != kind or len(block.offsets[0]) != end - start:
                raise InputError(
                    "the prompt's image/video tokens do not match the layout the graphs were exported with "
                    f"(row {row}, tokens {start}..{end} of type {kind}): export again with inputs of this layout"
                )
            offsets = torch.tensor(block.offsets, dtype=torch.long)
            fixed = torch.zeros(offsets.shape, dtype=torch.bool)
            if block.absolute:
                fixed = torch.tensor(block.absolute, dtype=torch.bool)
            positions.append(torch.where(fixed, offsets, offsets + current))
            if block.advance is None and index + 1 < len(runs):
                raise InputError(
                    f"text follows modality block {kind} of row {row}, which the export sample never had: "
                    "export with a sample whose image/video tokens are followed by text"
                )
            current += block.advance or 0
        if positions:
            values = torch.cat(positions, dim=1)
            rotary[:, row, where] = values
            deltas[row, 0] = int(values.max()) + 1 - len(where)
    if next(blocks, None) is not None:
        raise InputError(
            f"the prompt has fewer image/video blocks than the {len(template.blocks)} the graphs were exported "
            "with: export again with inputs of this layout"
        )
    if template.text_row:
        return torch.cat([text_positions(mask)[None], rotary]), deltas
    return rotary, deltas
