"""InternVL-style image features: the square patch grid taken as `int(patches ** 0.5)` needs static pixel sizes.

InternVL's `get_image_features` (and Qianfan-OCR's copy) turns the vision tower's patch sequence back into a
square grid by `feature_size = int(channels ** 0.5)` (`channels` is the patch count) and then pixel-shuffles it
with float sizes (`height % scale_factor`, `int(height * scale_factor)`). With the pixel height and width exported
dynamic (InternVL's tower interpolates its position embeddings, so nothing else fixes them), the patch count is a
symbol and the float arithmetic on its square root has no value range: the trace fails with
`ValueRangeError: Invalid ranges [0.5:-0.5]` in `pixel_shuffle`. The grid side is a function of the image size,
which the processor fixes (448 x 448 tiles): the rule keeps the pixel height and width at the sample's size
(torch.export's input guard then refuses another size), so the original code runs on plain ints, exactly; the
tile count (the image axis) stays dynamic.
"""

from __future__ import annotations

import functools
import inspect
import re
from typing import Any

import torch

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, MethodPatch
from hfexport.rewrites.rule import RuleMeta

# `feature_size = int(channels**0.5)`: a square grid side from a patch count, in Python.
_SQUARE_SIDE = re.compile(r"int\(\s*[\w.\[\]]+\s*\*\*\s*0\.5\s*\)")


@functools.cache
def _squares_its_patches(function: Any) -> bool:
    """Whether `function`'s code takes a square grid side as `int(n ** 0.5)` and pixel-shuffles that grid."""
    try:
        source = inspect.getsource(inspect.unwrap(function))
    except (OSError, TypeError):
        return False
    return bool(_SQUARE_SIDE.search(source)) and "pixel_shuffle" in source


def _applies(module: torch.nn.Module) -> bool:
    function = getattr(type(module), "get_image_features", None)
    return function is not None and _squares_its_patches(function)


def static_pixel_sizes(
    original: Any, self: torch.nn.Module, pixel_values: Any = None, *args: Any, **kwargs: Any
) -> Any:
    """The original with the pixel height and width fixed at the sample's (a trace's symbolic sizes only)."""
    if not isinstance(pixel_values, torch.Tensor) or pixel_values.ndim < 3:
        return NOT_APPLICABLE
    sizes = pixel_values.shape[-2:]
    if all(isinstance(size, int) for size in sizes):
        return NOT_APPLICABLE  # eager, or an export with static pixel sizes: the original is fine as it is
    from torch.fx.experimental.symbolic_shapes import guard_int

    for size in sizes:
        guard_int(size)  # specialise to the sample's value: the patch count and its square root become ints
    return original(pixel_values, *args, **kwargs)


class _Features(torch.nn.Module):
    """A tiny InternVL's image features (vision tower, square grid, pixel shuffle, projector)."""

    def __init__(self, image: int = 16) -> None:
        super().__init__()
        from transformers import InternVLConfig, InternVLModel

        torch.manual_seed(0)
        vision = {
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": [image, image],
            "patch_size": [4, 4],
        }
        text = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
        text |= {"num_key_value_heads": 2, "vocab_size": 32}
        config = InternVLConfig(vision_config=vision, text_config=text, downsample_ratio=0.5)
        config._attn_implementation = "sdpa"
        self.model = InternVLModel(config).eval()

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        config = self.model.config
        return self.model.get_image_features(
            pixel_values,
            vision_feature_layer=config.vision_feature_layer,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
            return_dict=True,
        ).pooler_output


def _tiles(count: int, seed: int = 0) -> dict[str, torch.Tensor]:
    return {"pixel_values": torch.rand(count, 3, 16, 16, generator=torch.Generator().manual_seed(seed))}


square_patch_grid_static = MethodPatch(
    RuleMeta(
        id="patch/square-patch-grid-static",
        why="InternVL's get_image_features takes the side of a square patch grid as `int(channels ** 0.5)` from "
        "the patch count and pixel-shuffles it with float sizes (`height % scale_factor`, "
        "`int(height * scale_factor)`); with the pixel height and width dynamic the patch count is a symbol and "
        "torch.export fails in pixel_shuffle ('ValueRangeError: Invalid ranges [0.5:-0.5]'). The pixel height and "
        "width are fixed at the sample's (the processor's tile size) for the call, so the same code runs on ints; "
        "the tile count stays dynamic",
        upstream="transformers==5.24.0 models/internvl/modeling_internvl.py InternVLModel.get_image_features and "
        "pixel_shuffle (copied by qianfan_ocr)",
        models=("internvl", "qianfan_ocr"),
        examples=(
            Match(
                lambda: (_Features(), _tiles(2)),
                "two 16 x 16 tiles (a 4 x 4 patch grid shuffled to 2 x 2), checked on three tiles too",
                other_inputs=lambda: _tiles(3, seed=1),
            ),
            NoMatch(
                lambda: (_Features(), _tiles(2)),
                "the same two tiles exported with static shapes (dynamic=False)",
                reason="declines when the pixel height and width are already ints (an export that is not dynamic)",
            ),
        ),
    ),
    target=_applies,
    method="get_image_features",
    replacement=static_pixel_sizes,
)
