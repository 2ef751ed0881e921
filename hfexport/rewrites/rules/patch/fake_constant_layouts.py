"""Layout tensors baked into a modality component stay constants while tracing."""

from __future__ import annotations

from typing import Any

import torch

from hfexport.generation_spec import LAYOUT_MAX_NUMEL, LayoutSpecialised
from hfexport.rewrites.example_models import dense_decoder
from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, ModuleFunctionPatch
from hfexport.rewrites.rule import RuleMeta


def may_turn_const(original: Any, mode: Any, tensor: torch.Tensor) -> Any:
    """Also keep small integer tensors as fake-tensor constants (torch keeps one element at most)."""
    if original(mode, tensor):
        return NOT_APPLICABLE
    integral = not (tensor.is_floating_point() or tensor.is_complex())
    if not integral or tensor.numel() > LAYOUT_MAX_NUMEL or tensor.device.type == "meta" or tensor.is_sparse:
        return NOT_APPLICABLE
    if mode.is_our_fake(tensor):
        return NOT_APPLICABLE
    return True


def _pixtral(sizes: list[list[int]]) -> tuple[torch.nn.Module, dict[str, Any]]:
    """Mistral3's vision tower (Pixtral) on images of unequal sizes, its `image_sizes` baked in."""
    from transformers import PixtralVisionConfig, PixtralVisionModel

    torch.manual_seed(0)
    config = PixtralVisionConfig(
        hidden_size=32, intermediate_size=37, num_hidden_layers=1, num_attention_heads=4, image_size=30, patch_size=6
    )
    tower = PixtralVisionModel(config).eval()
    module = LayoutSpecialised(tower, {"image_sizes": (sizes, torch.int64)})
    return module, {"pixel_values": torch.randn(len(sizes), 3, 30, 30)}


def _text_only() -> tuple[torch.nn.Module, dict[str, Any]]:
    """A layout-specialised component (the patch is installed) whose trace makes no integer literal."""
    model, inputs = dense_decoder()
    return LayoutSpecialised(model, {}), inputs


fake_constant_layouts = ModuleFunctionPatch(
    RuleMeta(
        id="patch/fake-constant-layouts",
        why="a vision tower splits its patches with `grid_thw.tolist()` (Qwen2-VL, Pixtral's image_sizes, "
        "LLaVA-NeXT...); torch.export traces that as unbacked ints and fails ('Could not guard on data-dependent "
        "expression'). hfexport bakes the sample's layout into the component as a literal tensor, but torch's "
        "fake tensors keep literal values only for tensors of at most one element (CONSTANT_NUMEL_LIMIT = 1), so "
        "the two-image grid still becomes data-dependent; small integer literals are kept as constants here, "
        "which is exact: their values are the literal's",
        upstream="torch==2.13.0 _subclasses/fake_tensor.py CONSTANT_NUMEL_LIMIT / FakeTensorMode.may_turn_const",
        models=("qwen3_vl_moe", "mistral3", "llava_next", "hunyuan_vl", "video_llama_3", "minimax_m3_vl"),
        examples=(
            Match(lambda: _pixtral([[30, 24], [18, 30], [30, 30]]), "three images of unequal, odd patch grids"),
            NoMatch(
                _text_only,
                "a layout-specialised text model without a layout",
                reason="installed on a layout-specialised component, but no small integer literal is traced",
            ),
        ),
    ),
    target="torch._subclasses.fake_tensor.FakeTensorMode.may_turn_const",
    replacement=may_turn_const,
    applies=lambda model: isinstance(model, LayoutSpecialised),
)
