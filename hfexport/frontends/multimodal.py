"""The multimodal parts of a model (modality encoders, projector) and the layouts baked into their components."""

from __future__ import annotations

import copy
import inspect
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from hfexport.frontends.calls import Components
from hfexport.generation_spec import LAYOUT_MAX_NUMEL, LayoutSpecialised, layout_mismatch
from hfexport.naming import canonical_output

# Submodule names under which multimodal models keep the projector from encoder features to text embeddings.
PROJECTOR_NAMES = ("multi_modal_projector", "connector", "embed_vision", "embed_audio")


MODALITIES = ("image", "audio")


def _submodule(root: torch.nn.Module, names: tuple[str, ...]) -> tuple[str, torch.nn.Module] | None:
    """The first submodule named like `names` on the model or its base model (`model.model`)."""
    holders = [root, getattr(root, "base_model", None), getattr(root, "model", None)]
    for holder in holders:
        if not isinstance(holder, torch.nn.Module):
            continue
        for name in names:
            module = getattr(holder, name, None)
            if isinstance(module, torch.nn.Module):
                return name, module
    return None


def multimodal_parts(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The modality encoders, projector, language model and lm_head of a multimodal model ({} otherwise)."""
    get_encoder = getattr(model, "get_encoder", None)
    if get_encoder is None:
        return {}
    parts: dict[str, torch.nn.Module] = {}
    for modality in MODALITIES:
        try:
            encoder = get_encoder(modality=modality)
        except (TypeError, ValueError):
            continue
        # `get_encoder` answers the model itself (or its base model) when it has no such encoder.
        if isinstance(encoder, torch.nn.Module) and encoder is not model and encoder is not model.base_model:
            parts[f"{modality}_encoder"] = encoder
    if not parts:
        return {}
    projector = _submodule(model, PROJECTOR_NAMES)
    if projector is not None:
        parts["multi_modal_projector"] = projector[1]
    decoder = model.get_decoder()
    if decoder is not model:
        parts["language_model"] = decoder
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, torch.nn.Module):
        parts["lm_head"] = head
    return parts


class ModalityFeatures(torch.nn.Module):
    """`base_model.get_<modality>_features(**kwargs)` as a module: what generate runs on pixel_values & co."""

    def __init__(self, model: torch.nn.Module, modality: str) -> None:
        super().__init__()
        self.base = model.base_model
        self.modality = modality

    def forward(self, **kwargs: Any) -> Any:
        return canonical_output(getattr(self.base, f"get_{self.modality}_features")(**kwargs))


def _modality_features(
    model: torch.nn.Module, kwargs: Mapping[str, Any], prefill: Mapping[str, Any]
) -> dict[str, tuple[torch.nn.Module, dict[str, Any]]]:
    """The `get_<modality>_features` calls generate made before prefill, with the kwargs it gave them
    (the modality inputs its signature names, `return_dict=True`), as transformers builds them."""
    given = prefill.get("mm_encoder_outputs")
    if not isinstance(given, Mapping):
        return {}
    out: dict[str, tuple[torch.nn.Module, dict[str, Any]]] = {}
    for modality in given:
        fn = getattr(model.base_model, f"get_{modality}_features", None)
        if fn is None:
            continue
        names = [k for k in inspect.signature(fn).parameters if k != "kwargs" and k in kwargs]
        call = {k: copy.deepcopy(kwargs[k]) for k in names}
        call["return_dict"] = True
        out[modality] = (ModalityFeatures(model, modality), call)
    return out


def _is_layout(name: str, value: Any) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.ndim >= 1
        and 0 < value.numel() <= LAYOUT_MAX_NUMEL
        and not value.is_floating_point()
        and not value.is_complex()
        and value.dtype != torch.bool
        and "mask" not in name
        and "input_ids" not in name
    )


def specialise_layouts(components: Components) -> tuple[Components, dict[str, dict[str, list[Any]]]]:
    """Modality components (`*_encoder`, `*_features`, the projector) with their layout inputs baked in.

    Returns the components to export and, per wrapped component, the baked values by input name.
    """
    out: Components = {}
    layouts: dict[str, dict[str, list[Any]]] = {}
    for name, (module, kwargs) in components.items():
        modality = name.endswith(("_encoder", "_features")) or name == "multi_modal_projector"
        layout = {k: v for k, v in kwargs.items() if modality and _is_layout(k, v)}
        if not layout:
            out[name] = (module, kwargs)
            continue
        baked = {k: (v.tolist(), v.dtype) for k, v in layout.items()}
        out[name] = (LayoutSpecialised(module, baked), {k: v for k, v in kwargs.items() if k not in layout})
        layouts[name] = {k: values for k, (values, _) in baked.items()}
    return out, layouts


# Inputs that hold an image's (or a video's) pixels: a forward that takes one is a pixel-input forward.
_PIXEL_INPUT = re.compile(r"^(pixel_values(_\w+)?|image_patches|flattened_patches)$")

Layout = dict[str, tuple[list[Any], torch.dtype]]


def is_vision_tower(model: Any) -> bool:
    """Whether `model` is a multimodal model's vision tower on its own (`AutoModel` of a `*_vision` config): its
    config is a vision sub-config (`base_config_key == "vision_config"`). Such a tower takes the patches under
    another name than `pixel_values` (`hidden_states` with `grid_thw` for the Qwen-VL/GLM-4V family)."""
    config = getattr(model, "config", None)
    return getattr(config, "base_config_key", None) == "vision_config"


def image_counts(inputs: Mapping[str, Any]) -> dict[str, int]:
    """The leading (image) axis size of every pixel input (`pixel_values`, `pixel_values_videos`...) of a feed."""
    return {
        k: int(v.shape[0])
        for k, v in inputs.items()
        if _PIXEL_INPUT.match(k) and isinstance(v, torch.Tensor) and v.ndim >= 1
    }


def specialised_image_axes(
    program: torch.export.ExportedProgram, inputs: Mapping[str, Any], dynamic_shapes: Mapping[str, Any] | None
) -> dict[str, int]:
    """The pixel inputs whose image axis (axis 0) was asked dynamic but the trace kept at the sample's size.

    torch.export specialises an axis that the forward turns into Python structure: `list(image_features)`
    (LLaVA), `split(counts.tolist())` per batch row (Idefics2/3, SmolVLM), `for i in range(batch_size)`
    (DeepSeek-OCR 2), each one output tensor per image or row. The program then holds for that count only.
    Only axes asked dynamic (`Dim.AUTO`, the `dynamic=True` default) of a sample of size >= 2 count: a size-1
    axis is static by torch's 0/1 specialisation, and a caller's own dynamic shapes are theirs.
    """
    if dynamic_shapes is None:
        return {}
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    user_inputs = set(program.graph_signature.user_inputs)
    out: dict[str, int] = {}
    for name, size in image_counts(inputs).items():
        spec = dynamic_shapes.get(name)
        asked = spec is torch.export.Dim.AUTO or (isinstance(spec, Mapping) and 0 in spec)
        asked = asked or (isinstance(spec, (list, tuple)) and len(spec) > 0 and spec[0] is not None)
        node = placeholders.get(name)
        if not asked or size < 2 or node is None or name not in user_inputs:
            continue
        value = node.meta.get("val")
        count = _static_size(value.shape[0]) if isinstance(value, torch.Tensor) and value.ndim >= 1 else None
        if count is not None:
            out[name] = count
    return out


def _static_size(size: Any) -> int | None:
    """`size` as an int when the trace fixed it (a plain int, or a symbol replaced by a number), else None."""
    if isinstance(size, int):
        return size
    node = getattr(size, "node", None)
    if node is None:
        return None
    expr = node.shape_env.replace(node.expr) if node.shape_env is not None else node.expr
    return int(expr) if getattr(expr, "is_number", False) else None


def pixel_layouts(inputs: Mapping[str, Any], vision_tower: bool = False) -> Layout:
    """The image layout inputs of a pixel-input forward's sample (`image_grid_thw`, `image_sizes`,
    `spatial_shapes`...), with their values and dtypes; {} for any other forward. A vision tower's forward
    (`vision_tower`, see `is_vision_tower`) is a pixel-input forward whatever its patches are called.

    A layout is a small integer tensor (`_is_layout`) that is not per token: token-type ids and anything with
    the text's `[batch, length]` axes stay inputs, so the text length stays dynamic.
    """
    pixels = any(_PIXEL_INPUT.match(k) and isinstance(v, torch.Tensor) for k, v in inputs.items())
    if not pixels and not vision_tower:
        return {}
    text = inputs.get("input_ids")
    text_axes = tuple(text.shape[:2]) if isinstance(text, torch.Tensor) and text.ndim >= 2 else None
    layout: Layout = {}
    for name, value in inputs.items():
        if not _is_layout(name, value) or "token" in name:
            continue
        if text_axes is not None and value.ndim >= 2 and tuple(value.shape[:2]) == text_axes:
            continue
        layout[name] = (value.tolist(), value.dtype)
    return layout


def bake_layout(forward: Callable[..., Any], layout: Layout, what: str) -> Callable[..., Any]:
    """`forward` with the `layout` inputs replaced by literals of their sample values, which the trace keeps as
    constants (rule `patch/fake-constant-layouts`), so the vision tower's `grid.tolist()` splits are static.

    The inputs stay in the signature: each is compared with its literal by an in-graph assertion, so the
    program refuses another layout at run time with an error naming the expected one (torch.export's own input
    guards refuse another shape first). Lowerings that drop assertions check the feed instead (`LAYOUT_META`).
    """

    def forward_with_baked_layout(**kwargs: Any) -> Any:
        for name, (values, dtype) in layout.items():
            literal = torch.tensor(values, dtype=dtype)
            given = kwargs[name]
            if isinstance(given, torch.Tensor):
                torch._assert_async(torch.all(given == literal), layout_mismatch(what, name, values, "another layout"))
            kwargs[name] = literal
        return forward(**kwargs)

    return forward_with_baked_layout
