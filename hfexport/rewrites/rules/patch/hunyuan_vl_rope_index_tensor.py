"""HunYuan-VL's multimodal rotary index (`get_rope_index`) as tensor ops over the whole batch.

`HunYuanVLModel.get_rope_index` walks each row's unmasked `mm_token_type_ids` in Python
(`itertools.groupby(x.tolist())`) to find the image spans and writes each image's pooled (width, height, image
ordinal) positions into its span. torch.export cannot trace the walk ('Could not guard on data-dependent expression
Eq(u1, 0)' in `unbind`). With the image grid baked into the graph (its values known while tracing), the same
positions are cumulative sums and gathers over the token types and the mask, for any batch and text length.
"""

from __future__ import annotations

from typing import Any

import torch

from hfexport.generation_spec import LayoutSpecialised
from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, MethodPatch
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.patch._rope_index import masked_positions_and_deltas


def _known_grid(tensor: Any) -> list[list[int]] | None:
    """The grid's rows when its values are known (a baked literal while tracing, or eagerly), else None."""
    if not isinstance(tensor, torch.Tensor) or tensor.ndim != 2 or tensor.shape[-1] != 3:
        return None
    if tensor.is_floating_point() or tensor.is_complex():
        return None
    values = tensor.tolist()
    # A traced input grid gives unbacked SymInts: only a literal gives Python ints.
    if not all(type(v) is int for row in values for v in row):
        return None
    return values


def rope_index(
    original: Any,
    self: torch.nn.Module,
    input_ids: torch.Tensor,
    mm_token_type_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> Any:
    """The original's positions and deltas for a baked grid.

    Every unmasked token gets its index among the row's unmasked tokens on every axis; a span (a maximal run of
    image tokens among the unmasked ones, matched to the grid rows in batch-major order, as the original's shared
    grid iterator does) of `n` or `n + 2` tokens, `n = (h // m) * (w // m + 1)`, gives its `n` grid tokens (after a
    leading boundary token when `n + 2`) the image's pooled width, height and ordinal on the last three axes.
    Masked tokens are 0. Inputs the original refuses (more or fewer spans than images, a span of another length)
    fail an assertion instead.
    """
    from torch._guards import detect_fake_mode

    if detect_fake_mode() is None:
        return NOT_APPLICABLE  # eagerly the original runs as is
    grids = _known_grid(image_grid_thw)
    if not grids or kwargs or not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
        return NOT_APPLICABLE
    if mm_token_type_ids is None or (attention_mask is not None and attention_mask.shape != input_ids.shape):
        return NOT_APPLICABLE
    axes = len((self.config.text_config.rope_parameters or {}).get("mrope_section", []))
    merge = self.config.vision_config.spatial_merge_size
    if axes < 3 or any(h // merge == 0 for _, h, _ in grids):
        return NOT_APPLICABLE  # the original raises (too few axes) or builds an empty grid: leave it that
    device = input_ids.device
    batch, length = input_ids.shape
    images = len(grids)
    # Per image: pooled width + 1 (a newline token closes each row), grid token count.
    table = torch.tensor(
        [[w // merge + 1, (h // merge) * (w // merge + 1)] for _, h, w in grids], dtype=torch.long, device=device
    )
    types = mm_token_type_ids.long()
    valid = attention_mask.bool() if attention_mask is not None else torch.ones_like(types, dtype=torch.bool)
    image = valid & (types == 1)
    compact = valid.long().cumsum(1) - 1  # the index among the row's unmasked tokens
    # A span starts at an image token whose previous unmasked token (in its row) is not an image token.
    slots = torch.where(valid, compact, length)
    by_slot = torch.zeros(batch, length + 1, dtype=torch.long, device=device).scatter(1, slots, image.long())
    previous = by_slot.gather(1, (compact - 1).clamp(min=0)).bool() & (compact > 0)
    starts = image & ~previous
    flat_starts, flat_image = starts.reshape(-1), image.reshape(-1).long()
    span = flat_starts.long().cumsum(0) - 1  # the image of each token's span, batch-major
    ordinal = span.clamp(0, images - 1)
    bucket = torch.where(flat_image.bool(), span.clamp(0, images), images)
    seen = flat_image.cumsum(0) - flat_image  # image tokens before each token, batch-major
    first = torch.zeros(images + 1, dtype=torch.long, device=device).scatter_add(
        0, torch.where(flat_starts, span.clamp(0, images), images), torch.where(flat_starts, seen, 0)
    )
    counts = torch.zeros(images + 1, dtype=torch.long, device=device).scatter_add(0, bucket, flat_image)
    tokens = table[:, 1]
    torch._assert_async(
        (flat_starts.long().sum() == images) & ((counts[:images] == tokens) | (counts[:images] == tokens + 2)).all(),
        "get_rope_index: the image placeholder spans do not match image_grid_thw",
    )
    row = table.index_select(0, ordinal)
    width, grid_tokens = row[:, 0], row[:, 1]
    boundary = (counts.index_select(0, ordinal) == grid_tokens + 2).long()
    at = seen - first.index_select(0, ordinal) - boundary  # the token's index in its image's grid
    in_grid = (flat_image.bool() & (at >= 0) & (at < grid_tokens)).reshape(batch, length)
    at = at.clamp(min=0)
    pooled = (at % width, at // width, ordinal)
    planes = [compact] * (axes - 3) + [torch.where(in_grid, value.reshape(batch, length), compact) for value in pooled]
    return masked_positions_and_deltas(torch.stack(planes), valid, input_ids.dtype)


# -- examples --------------------------------------------------------------------------------------


class _RopeIndex(torch.nn.Module):
    """HunYuan-VL's rope index over a baked grid, as its forward computes it before the decoder."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import HunYuanVLConfig, HunYuanVLModel

        small = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
        text = {**small, "vocab_size": 32, "num_key_value_heads": 2, "head_dim": 8}
        text["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 1, 1]}
        vision = {**small, "num_key_value_heads": 2, "out_hidden_size": 16, "text_hidden_size": 16}
        vision["spatial_merge_size"] = 2
        self.model = HunYuanVLModel(HunYuanVLConfig(text_config=text, vision_config=vision, image_token_id=5))

    def forward(
        self,
        input_ids: torch.Tensor,
        mm_token_type_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        image_grid_thw: torch.Tensor,
    ) -> torch.Tensor:
        positions, deltas = self.model.get_rope_index(
            input_ids, mm_token_type_ids, image_grid_thw=image_grid_thw, attention_mask=attention_mask
        )
        # Each axis weighted differently, so a position on the wrong axis shows.
        weights = torch.arange(1, positions.shape[0] + 1, dtype=torch.float32).view(-1, 1, 1)
        return (positions.float() * weights).sum(0) + deltas


# Grids (merge 2): image 0 is 4x4 -> 2 rows of 2 + 1 = 6 tokens; image 1 is 2x6 -> 1 row of 3 + 1 = 4 tokens.
_GRID = [[1, 4, 4], [1, 2, 6]]


def _rows(extra: int) -> dict[str, torch.Tensor]:
    # Row 0: 2 text, image 0 with its two boundary tokens (8), 2 text. Row 1: 3 padding, 1 text, image 1 without
    # boundary tokens (4), 4 text.
    types = torch.tensor([[0, 0] + [1] * 8 + [0, 0], [0, 0, 0, 0] + [1] * 4 + [0, 0, 0, 0]])
    mask = torch.tensor([[1] * 12, [0, 0, 0] + [1] * 9])
    types = torch.cat([types, torch.zeros(2, extra, dtype=torch.long)], 1)
    mask = torch.cat([mask, torch.ones(2, extra, dtype=torch.long)], 1)
    return {"input_ids": torch.where(types == 1, 5, 3), "mm_token_type_ids": types, "attention_mask": mask}


def _baked() -> tuple[torch.nn.Module, dict[str, Any]]:
    torch.manual_seed(0)
    return LayoutSpecialised(_RopeIndex().eval(), {"image_grid_thw": (_GRID, torch.int64)}), _rows(0)


def _one_row_both_images() -> tuple[torch.nn.Module, dict[str, Any]]:
    """Both images in row 0, the first split by a masked token (still one span); row 1 text with a type-2 token."""
    torch.manual_seed(0)
    types = torch.tensor(
        [[0, 1, 1, 1, 0, 1, 1, 1, 1, 1, 0, 1, 1, 1, 1, 0], [0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]]
    )
    mask = torch.tensor([[1, 1, 1, 1, 0] + [1] * 11, [0, 0] + [1] * 14])
    inputs = {"input_ids": torch.where(types == 1, 5, 3), "mm_token_type_ids": types, "attention_mask": mask}
    return LayoutSpecialised(_RopeIndex().eval(), {"image_grid_thw": (_GRID, torch.int64)}), inputs


def _text_only() -> tuple[torch.nn.Module, dict[str, Any]]:
    """The rope index asked without a grid (text-only rows): the original's plain positions."""

    class _NoGrid(_RopeIndex):
        def forward(self, input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor) -> torch.Tensor:
            positions, deltas = self.model.get_rope_index(input_ids, mm_token_type_ids)
            return positions.float().sum(0) + deltas

    types = torch.zeros(2, 7, dtype=torch.long)
    return _NoGrid().eval(), {"input_ids": torch.full((2, 7), 3), "mm_token_type_ids": types}


hunyuan_vl_rope_index_tensor = MethodPatch(
    RuleMeta(
        id="patch/hunyuan-vl-rope-index-tensor",
        why="HunYuan-VL finds the image spans of each row with `itertools.groupby(mm_token_type_ids[b].tolist())` "
        "in its own get_rope_index (spans of `grid` or `grid + 2` tokens, a 4-axis M-RoPE whose last three axes "
        "are pooled width, height and image ordinal): torch.export fails on the Python walk over tensor data "
        "('Could not guard on data-dependent expression Eq(u1, 0)', unbind). With the grid baked (export() of a "
        "pixel-input forward), the same positions and deltas are cumulative sums and gathers over the token types "
        "and mask, exact for any batch and text length",
        upstream="transformers==5.24.0 models/hunyuan_vl/modeling_hunyuan_vl.py HunYuanVLModel.get_rope_index",
        models=("hunyuan_vl",),
        examples=(
            Match(
                _baked,
                "an image with boundary tokens, a left-padded row with one without, then 5 more text tokens",
                other_inputs=lambda: _rows(5),
                needs=("patch/fake-constant-layouts",),
            ),
            Match(
                _one_row_both_images,
                "both images in one row, a masked token inside a span, a token of another type",
                needs=("patch/fake-constant-layouts",),
            ),
            NoMatch(_text_only, "text only (no grid)", reason="declines a call without a grid known while tracing"),
        ),
    ),
    target="transformers.models.hunyuan_vl.modeling_hunyuan_vl.HunYuanVLModel.get_rope_index",
    replacement=rope_index,
)
