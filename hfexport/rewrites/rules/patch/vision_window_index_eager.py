"""Qwen2.5-VL-style window attention: the window index and its lengths computed on the baked image grid.

`transformers.vision_utils.get_vision_window_index` builds, per image of `grid_thw`, the order of the merged
patches by window and the cumulative window lengths. It does so with tensors made by `torch.arange`, a boolean
selection (`index_padded[index_padded != -100]`), `.tolist()` of a cumulative sum and `torch.unique_consecutive`.
Even with the grid baked into the graph (its values known while tracing), those factory-made tensors carry no
values in torch's fake tensors, so the window lengths become unbacked ints and the attention's
`torch.split(x, lengths.tolist())` fails ('Could not guard on data-dependent expression
Eq(Max(0, u4 - Min(1, u4)), 0)'). Everything the helper returns is a function of the grid alone: with the grid
known, it is evaluated eagerly on the grid's values and returned as literals, exactly what the original computes.
"""

from __future__ import annotations

from typing import Any

import torch

from hfexport.generation_spec import LayoutSpecialised
from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, ModuleFunctionPatch
from hfexport.rewrites.rule import RuleMeta

# Every transformers module that imports `get_vision_window_index` from `transformers.vision_utils` (the name is
# looked up in the importer's module, so each is gated there). tests/rewrites/test_vision_window_index_eager.py
# derives this list from transformers' sources and fails on a copy that is missing here.
IMPORTERS = (
    "exaone4_5.modeling_exaone4_5",
    "minicpm_ocr.modeling_minicpm_ocr",
    "minicpmv4_6.modeling_minicpmv4_6",
    "minicpmv4_7.modeling_minicpmv4_7",
    "muse_glimmer.modeling_muse_glimmer",
    "muse_spark.modeling_muse_spark",
    "qwen2_5_omni.modeling_qwen2_5_omni",
    "qwen2_5_vl.modeling_qwen2_5_vl",
)


def _known_grid(grid_thw: Any) -> list[list[int]] | None:
    """The grid's values when they are known while tracing (a baked literal), else None.

    Eagerly (no fake mode) the original is exact and traceable questions do not arise, so that declines too.
    """
    from torch._guards import detect_fake_mode

    if not isinstance(grid_thw, torch.Tensor) or grid_thw.ndim != 2 or detect_fake_mode() is None:
        return None
    if grid_thw.is_floating_point() or grid_thw.is_complex():
        return None
    values = grid_thw.tolist()
    # An input grid traces as unbacked SymInts: only a literal the fake tensors kept gives Python ints.
    if not all(type(v) is int for row in values for v in row):
        return None
    return values


def window_index(
    original: Any,
    grid_thw: torch.Tensor,
    spatial_merge_size: int,
    window_size: int,
    patch_size: int,
    kwargs: dict[str, Any] | None = None,
) -> Any:
    """`(window_index, cu_window_seqlens)` of the original, computed eagerly on a grid known while tracing."""
    if kwargs is not None and ("window_index" in kwargs or "cu_window_seqlens" in kwargs):
        return NOT_APPLICABLE  # precomputed by the caller: the original pops and returns them
    values = _known_grid(grid_thw)
    if values is None:
        return NOT_APPLICABLE
    from torch.utils._python_dispatch import _disable_current_modes

    # Outside every tracing mode: real tensors, real values; the original (not a copy) does the computation.
    with _disable_current_modes():
        index, cu_seqlens = original(
            torch.tensor(values, dtype=torch.int64),
            spatial_merge_size=spatial_merge_size,
            window_size=window_size,
            patch_size=patch_size,
        )
        index_values, cu_values = index.tolist(), cu_seqlens.tolist()
    # Literals, as the baked grid itself: constants of the graph (the small cumulative lengths stay known to
    # the fake tensors through `patch/fake-constant-layouts`, so the attention's splits are Python ints).
    device = grid_thw.device
    return (
        torch.tensor(index_values, dtype=index.dtype, device=device),
        torch.tensor(cu_values, dtype=cu_seqlens.dtype, device=device),
    )


def _tower(
    grid: list[list[int]], precomputed: bool = False, window_size: int = 16
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Qwen2.5-VL's vision tower (window attention in every block but the last), its grid baked in.

    `precomputed`: the caller also bakes the window index and lengths (transformers' `vision_utils` lets a
    caller pass them), so the helper returns those.
    """
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    torch.manual_seed(0)
    config = Qwen2_5_VLVisionConfig(
        depth=2,
        hidden_size=32,
        intermediate_size=48,
        num_heads=2,
        out_hidden_size=32,
        patch_size=2,
        spatial_merge_size=2,
        temporal_patch_size=1,
        window_size=window_size,
        fullatt_block_indexes=[1],
        in_channels=3,
    )
    config._attn_implementation = "sdpa"
    tower = Qwen2_5_VisionTransformerPretrainedModel(config).eval()
    patches = sum(t * h * w for t, h, w in grid)
    layout: dict[str, tuple[list[Any], torch.dtype]] = {"grid_thw": (grid, torch.int64)}
    if precomputed:
        from transformers.vision_utils import get_vision_window_index

        index, cu_seqlens = get_vision_window_index(torch.tensor(grid), 2, window_size, 2)
        layout["window_index"] = (index.tolist(), index.dtype)
        layout["cu_window_seqlens"] = (cu_seqlens.tolist(), torch.int32)
    module = LayoutSpecialised(tower, layout)
    # One row per patch: channels x temporal patch x patch x patch.
    return module, {"hidden_states": torch.randn(patches, 3 * 1 * 2 * 2)}


vision_window_index_eager = ModuleFunctionPatch(
    RuleMeta(
        id="patch/vision-window-index-eager",
        why="Qwen2.5-VL-style vision towers window their attention by `get_vision_window_index(grid_thw)`, "
        "which builds the window order with `torch.arange`, a boolean selection, `.tolist()` of a cumsum and "
        "`unique_consecutive`; torch's fake tensors keep no values for those factory-made tensors even when the "
        "grid is a baked literal, so the window lengths become unbacked and the attention's "
        "`torch.split(x, lengths.tolist())` fails ('Could not guard on data-dependent expression "
        "Eq(Max(0, u4 - Min(1, u4)), 0)'). With the grid known while tracing, the same function is run eagerly "
        "on the grid's values and its results become literals: exact, they depend on the grid alone",
        upstream="transformers==5.24.0 vision_utils.py get_vision_window_index",
        models=("qwen2_5_vl", "exaone4_5", "hyperclovax_vision_v2", "minicpmv4_6", "qwen2_5_omni_thinker"),
        # The literals stay known while tracing only with the first; the lowerings that re-trace the program
        # (and a saved .pt2) keep them static only with the second, as for the baked grid itself.
        requires=("patch/fake-constant-layouts", "fx/fold-layout-constants"),
        examples=(
            Match(
                lambda: _tower([[1, 12, 8], [2, 4, 4], [1, 6, 10]]),
                "three images and a two-frame video, grids of odd merged sizes that pad their last window",
                known_failure={
                    "executorch": "the runtime fails in the tower's patch embedding, a Conv3d: ExecuTorch's portable "
                    "convolution takes 3-D or 4-D inputs only ('Expect input tensor to be 3-D or 4-D, but got, 5', "
                    "aten::convolution.out 0x12), before any window attention runs: an ExecuTorch coverage gap of the "
                    "Qwen2.5-VL tower (#17)"
                },
            ),
            NoMatch(
                lambda: _tower([[1, 12, 8], [1, 6, 10]], precomputed=True),
                "the caller passes the window index and lengths (baked too)",
                reason="declines a call given precomputed `window_index`/`cu_window_seqlens` (the original returns "
                "them)",
            ),
        ),
    ),
    target=tuple(f"transformers.models.{path}.get_vision_window_index" for path in IMPORTERS),
    replacement=window_index,
)
