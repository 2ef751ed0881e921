"""Qwen2-VL's multimodal rotary index (`get_rope_index`) as tensor ops over the whole batch.

`get_rope_index` walks each row of `mm_token_type_ids` in Python (`itertools.groupby(x.tolist())`) to find the
image spans, then concatenates per-span position blocks. torch.export cannot trace a Python walk over tensor
data ('Could not guard on data-dependent expression Eq(u2, 0)'). With the image grid baked into the graph
(its values known while tracing), the same positions are a closed form of cumulative sums over the token types
and the attention mask, for any batch and text length.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any

import torch

from hfexport.generation_spec import LayoutSpecialised
from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, MethodPatch
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.patch._rope_index import masked_positions_and_deltas

# The models whose `get_rope_index` and `get_vision_position_ids` are Qwen2-VL's for images (a copy each; they
# differ only in how they split videos, which the replacement declines).
_COPIES = (
    "qwen2_vl.modeling_qwen2_vl.Qwen2VLModel",
    "qwen2_5_vl.modeling_qwen2_5_vl.Qwen2_5_VLModel",
    "qwen3_vl.modeling_qwen3_vl.Qwen3VLModel",
    "qwen3_vl_moe.modeling_qwen3_vl_moe.Qwen3VLMoeModel",
    "qwen3_5.modeling_qwen3_5.Qwen3_5Model",
    "qwen3_5_moe.modeling_qwen3_5_moe.Qwen3_5MoeModel",
    "glm4v.modeling_glm4v.Glm4vModel",
    "glm4v_moe.modeling_glm4v_moe.Glm4vMoeModel",
    "glm46v.modeling_glm46v.Glm46VModel",
    "glm_ocr.modeling_glm_ocr.GlmOcrModel",
    "cosmos3_edge.modeling_cosmos3_edge.Cosmos3EdgeModel",
    "cosmos3_omni.modeling_cosmos3_omni.Cosmos3OmniModel",
)


@functools.cache
def _copies() -> tuple[tuple[Any, Any], ...]:
    """(get_rope_index, get_vision_position_ids) of every copy importable here."""
    found = []
    for path in _COPIES:
        module_path, _, name = path.rpartition(".")
        try:
            cls = getattr(importlib.import_module(f"transformers.models.{module_path}"), name)
        except (ImportError, AttributeError):
            continue
        found.append((cls.get_rope_index, cls.get_vision_position_ids))
    return tuple(found)


def _is_copy(module: torch.nn.Module) -> bool:
    methods = (getattr(type(module), "get_rope_index", None), getattr(type(module), "get_vision_position_ids", None))
    # Before importing the copies' modules (about 2 s): most modules have neither method.
    return None not in methods and methods in _copies()


def _constant_values(tensor: Any) -> list[list[int]] | None:
    """The values of a layout tensor known while tracing (a baked literal) or eagerly; None for a traced input."""
    from torch._subclasses.fake_tensor import FakeTensor

    if not isinstance(tensor, torch.Tensor) or tensor.ndim != 2 or tensor.shape[-1] != 3:
        return None
    if isinstance(tensor, FakeTensor):
        if tensor.constant is None:
            return None
        tensor = tensor.constant
    if torch._C._functorch.is_functorch_wrapped_tensor(tensor) or type(tensor) is not torch.Tensor:
        return None
    return [[int(v) for v in row] for row in tensor.tolist()]


def rope_index(
    original: Any,
    self: torch.nn.Module,
    input_ids: torch.Tensor,
    mm_token_type_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> Any:
    """The positions of the original for images: text tokens count on from the previous span's end, an image of
    grid (t, h, w) gets (start + t_i, start + h_i, start + w_i) over its merged grid and advances the text
    position by max(h, w) // merge. Spans are maximal runs of image tokens among the unmasked tokens, matched
    to the grid rows in row-major order. Inputs the original refuses (more spans than images, a span whose
    length is not its image's token count, a token type other than text or image) fail an assertion instead.
    """
    grids = _constant_values(image_grid_thw)
    if video_grid_thw is not None or grids is None or not grids:
        return NOT_APPLICABLE  # videos (their own split), or a grid only known at run time
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2 or mm_token_type_ids is None:
        return NOT_APPLICABLE
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        return NOT_APPLICABLE
    merge = self.config.vision_config.spatial_merge_size
    if any(h // merge == 0 or w // merge == 0 for _, h, w in grids):
        return NOT_APPLICABLE
    device = input_ids.device
    batch, length = input_ids.shape
    images = len(grids)
    # Per image: merged height and width, the text-position advance, the token count.
    table = torch.tensor(
        [[h // merge, w // merge, max(h, w) // merge, t * (h // merge) * (w // merge)] for t, h, w in grids],
        dtype=torch.long,
        device=device,
    )
    types = mm_token_type_ids.long()
    valid = attention_mask.bool() if attention_mask is not None else torch.ones_like(types, dtype=torch.bool)
    image = valid & (types == 1)
    text = valid & (types == 0)
    # A span starts at an image token whose previous unmasked token is not an image token.
    compact = valid.long().cumsum(1) - 1
    slots = torch.where(valid, compact, length)
    by_slot = torch.zeros(batch, length + 1, dtype=torch.long, device=device).scatter(1, slots, image.long())
    previous = by_slot.gather(1, (compact - 1).clamp(min=0)).bool() & (compact > 0)
    starts = image & ~previous
    flat_starts, flat_image = starts.reshape(-1), image.reshape(-1).long()
    span = flat_starts.long().cumsum(0) - 1  # the image each token's span takes, in the original's order
    bucket = torch.where(flat_image.bool(), span.clamp(0, images), images)
    seen = flat_image.cumsum(0) - flat_image  # image tokens before each token, batch-major
    first = torch.zeros(images + 1, dtype=torch.long, device=device).scatter_add(
        0, torch.where(flat_starts, span.clamp(0, images), images), torch.where(flat_starts, seen, 0)
    )
    counts = torch.zeros(images + 1, dtype=torch.long, device=device).scatter_add(0, bucket, flat_image)
    spans = flat_starts.long().sum()
    numbered = torch.arange(images, device=device)
    torch._assert_async(
        (spans <= images)
        & ((counts[:images] == table[:, 3]) | (numbered >= spans)).all()
        & ~(valid & (types != 0) & (types != 1)).any(),
        "get_rope_index: the image token spans do not match image_grid_thw",
    )
    row = table.index_select(0, span.clamp(0, images - 1)).reshape(batch, length, 4)
    height, width, advance = row[..., 0], row[..., 1], row[..., 2]
    offset = (seen - first.index_select(0, span.clamp(0, images - 1))).reshape(batch, length)
    text_before = text.long().cumsum(1) - text.long()
    advanced = torch.where(starts, advance, 0).cumsum(1)  # spans started at or before each token
    text_position = text_before + advanced
    start = text_position - advance
    axes = (
        offset // (height * width),
        (offset // width) % height,
        offset % width,
    )
    positions = torch.stack([torch.where(image, start + axis, text_position) for axis in axes])
    return masked_positions_and_deltas(positions, valid, input_ids.dtype)


# -- examples --------------------------------------------------------------------------------------


class _RopeIndex(torch.nn.Module):
    """Qwen2-VL's rope index over a baked two-image grid, as its forward computes it before the decoder."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import Qwen2VLConfig, Qwen2VLModel

        text = {"vocab_size": 32, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1}
        text.update(num_attention_heads=2, num_key_value_heads=1, rope_parameters={"mrope_section": [2, 1, 1]})
        vision = {"depth": 1, "embed_dim": 16, "hidden_size": 16, "num_heads": 2, "patch_size": 2}
        self.model = Qwen2VLModel(Qwen2VLConfig(text_config=text, vision_config=vision))

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
        return positions.float().sum(0) + deltas


def _rows(extra: int) -> dict[str, torch.Tensor]:
    # Row 0: 2 text, a 2x2 image, 4 text (+ extra). Row 1: 2 padding, 1 text, a 2x3 image, 1 text (+ extra).
    types = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1, 1, 1, 1, 0]])
    mask = torch.tensor([[1] * 10, [0, 0] + [1] * 8])
    types = torch.cat([types, torch.zeros(2, extra, dtype=torch.long)], 1)
    mask = torch.cat([mask, torch.ones(2, extra, dtype=torch.long)], 1)
    return {"input_ids": torch.where(types == 1, 7, 3), "mm_token_type_ids": types, "attention_mask": mask}


def _two_images() -> tuple[torch.nn.Module, dict[str, Any]]:
    torch.manual_seed(0)
    module = LayoutSpecialised(_RopeIndex().eval(), {"image_grid_thw": ([[1, 4, 4], [1, 4, 6]], torch.int64)})
    return module, _rows(0)


class _RopeIndexOfInput(_RopeIndex):
    """The same call with the grid as a traced input (not baked): no values to compute the spans from."""

    def forward(self, input_ids: torch.Tensor, mm_token_type_ids: torch.Tensor, image_grid_thw: torch.Tensor) -> Any:
        positions, _ = self.model.get_rope_index(input_ids, mm_token_type_ids, video_grid_thw=image_grid_thw)
        return positions.float()


def _videos() -> tuple[torch.nn.Module, dict[str, Any]]:
    torch.manual_seed(0)
    types = torch.tensor([[0, 2, 2, 2, 2, 0]])
    ids = torch.where(types == 2, 7, 3)
    return _RopeIndexOfInput().eval(), {
        "input_ids": ids,
        "mm_token_type_ids": types,
        "image_grid_thw": torch.tensor([[1, 4, 4]]),
    }


mrope_index_tensor = MethodPatch(
    RuleMeta(
        id="patch/mrope-index-tensor",
        why="Qwen2-VL-style models (Qwen2/2.5/3-VL, Qwen3.5, GLM-4V, GLM-OCR, Cosmos3) find the image spans of "
        "each row with `itertools.groupby(mm_token_type_ids[b].tolist())` in get_rope_index: torch.export fails "
        "on the Python walk over tensor data ('Could not guard on data-dependent expression Eq(u2, 0)'). With "
        "the image grid baked (export() of a pixel-input forward), the same positions and deltas are cumulative "
        "sums over the token types and mask, exact for any batch and text length",
        upstream="transformers==5.24.0 models/qwen2_vl/modeling_qwen2_vl.py Qwen2VLModel.get_rope_index "
        "(and its copies)",
        models=("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "glm4v", "glm46v"),
        examples=(
            Match(
                _two_images,
                "two images of unequal grids, a left-padded row, then 9 more text tokens",
                other_inputs=lambda: _rows(9),
                needs=("patch/fake-constant-layouts",),
            ),
            NoMatch(
                _videos,
                "video tokens (a video grid)",
                reason="the replacement declines videos: the copies split their frames differently",
            ),
        ),
    ),
    target=_is_copy,
    method="get_rope_index",
    replacement=rope_index,
)
