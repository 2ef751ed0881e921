"""The `GenerationSpec` of a set of components: how a runtime feeds each (inputs, cache, positions, tokens)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from hfexport.core.errors import InputError
from hfexport.core.positions import MultimodalPositions
from hfexport.core.positions import derive as derive_positions
from hfexport.frontends.calls import _LOOP_KWARGS, Components, _cache_key, _is_static, _linear_only, _query_length
from hfexport.frontends.torch_export import scalar_sequence
from hfexport.generation_spec import CacheLeaf, ComponentSpec, GenerationSpec
from hfexport.naming import tensor_leaves


class GenerationComponents(dict):
    """`{component name: native program}`, as `export_for_generation` returns it, plus how to run them.

    The dict holds the documented components only. `runtime_components` holds the programs
    `hfexport.runtime.generate` runs beyond them (a multimodal model's `<modality>_features` and `prefill`;
    empty for the others). `spec` (a `GenerationSpec`, describing both) and `samples` (the captured forward
    kwargs of both) let `hfexport.runtime.generate` drive them without the source model.
    """

    spec: GenerationSpec
    samples: dict[str, dict[str, Any]]
    runtime_components: dict[str, Any]


def _leaves(value: Any, prefix: str) -> list[tuple[str, torch.Tensor]]:
    from hfexport.core.cache_pytree import register_cache_pytrees
    from hfexport.naming import leaf_names

    register_cache_pytrees()
    return [(n, t) for n, t in leaf_names({prefix: value}) if isinstance(t, torch.Tensor)]


def _masks_current_only(cache: Any, kwargs: Mapping[str, Any]) -> bool:
    """A recurrent state that is not a `Cache` (RWKV's list of tensors) has no length: generate's mask for the
    step then covers its current tokens only, as the recorded step shows."""
    from transformers.cache_utils import Cache

    mask = kwargs.get("attention_mask")
    if isinstance(cache, Cache) or not isinstance(mask, torch.Tensor) or mask.ndim != 2:
        return False
    return mask.shape[-1] == _query_length(kwargs)


def _nested(value: Any) -> bool:
    return isinstance(value, (tuple, list, Mapping))


def describe(
    components: Components,
    generation_config: Any,
    model: torch.nn.Module,
    multi_token_decode: bool,
    generate_kwargs: Mapping[str, Any] | None = None,
) -> GenerationSpec:
    """The `GenerationSpec` of decomposed components (tensor inputs in graph order, sample shapes, cache layout).

    `constants` is empty for the pairs of `decompose_for_generation` (their Python arguments are fixed inside)."""
    specs: dict[str, ComponentSpec] = {}
    cache_key = None
    static = False
    max_len = None
    batch = 1
    current_only = False
    for name, (_, kwargs) in components.items():
        key = _cache_key(kwargs)
        cache_key = cache_key or key
        # Tensor inputs, pytrees of tensors (`encoder_outputs`: a tuple or a ModelOutput) and the cache.
        tensors = [
            k
            for k, v in kwargs.items()
            if (isinstance(v, (torch.Tensor, tuple, list, Mapping)) and not scalar_sequence(v)) or k == key
        ]
        constants = {
            k: v
            for k, v in kwargs.items()
            if k not in tensors and (isinstance(v, (int, float, bool, str, type(None))) or scalar_sequence(v))
        }
        mask = kwargs.get("attention_mask")
        leaves: list[CacheLeaf] = []
        if key is not None:
            cache = kwargs[key]
            current_only = current_only or _linear_only(cache) or _masks_current_only(cache, kwargs)
            if _is_static(cache):
                static = True
                lengths = [layer.get_max_length() for layer in cache.layers]
                max_len = max(lengths) if lengths else None
            leaves = [CacheLeaf(n, list(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in _leaves(cache, key)]
        ids = kwargs.get("input_ids", kwargs.get("decoder_input_ids"))
        if isinstance(ids, torch.Tensor):
            batch = ids.shape[0]
        specs[name] = ComponentSpec(
            inputs=tensors,
            constants=constants,
            mask_rank=mask.ndim if isinstance(mask, torch.Tensor) else None,
            cache_leaves=leaves,
            leaves={k: list(tensor_leaves({k: kwargs[k]})) for k in tensors if k != key and _nested(kwargs[k])},
        )
    from transformers.utils import ModelOutput

    encoder_sample = next((kw["encoder_outputs"] for _, kw in components.values() if "encoder_outputs" in kw), None)
    encoder_fields = list(encoder_sample.keys()) if isinstance(encoder_sample, ModelOutput) else []
    config = generation_config if generation_config is not None else getattr(model, "generation_config", None)
    eos_list = _ids(getattr(config, "eos_token_id", None))
    pad = getattr(config, "pad_token_id", None)
    forced_bos = getattr(config, "forced_bos_token_id", None)
    start = getattr(config, "decoder_start_token_id", None)
    if start is None:
        start = getattr(getattr(model, "config", None), "decoder_start_token_id", None)
    return GenerationSpec(
        components=specs,
        cache_key=cache_key,
        static_cache=static,
        max_cache_len=max_len,
        multi_token_decode="decode" in components and _query_length(components["decode"][1]) > 1,
        sample_batch=batch,
        is_encoder_decoder=bool(getattr(getattr(model, "config", None), "is_encoder_decoder", False)),
        mask_current_only=current_only,
        eos_token_id=eos_list,
        pad_token_id=None if pad is None else int(pad),
        decoder_start_token_id=start if isinstance(start, int) else None,
        forced_bos_token_id=forced_bos if isinstance(forced_bos, int) else None,
        forced_eos_token_id=_ids(getattr(config, "forced_eos_token_id", None)),
        suppress_tokens=_ids(getattr(config, "suppress_tokens", None)),
        begin_suppress_tokens=_ids(getattr(config, "begin_suppress_tokens", None)),
        encoder_output_fields=encoder_fields,
        decode_full_sequence=_decodes_full_sequence(components),
        positions=_multimodal_positions(components, model, generate_kwargs or {}),
    )


def _shifted_positions(
    model: torch.nn.Module, generate_kwargs: Mapping[str, Any], type_key: str | None, token_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """The model's own prompt positions with one more text token in front of each row (see `derive_positions`)."""
    hook = getattr(model, "_prepare_position_ids_for_generation", None)
    ids = generate_kwargs.get("input_ids")
    if hook is None or not isinstance(ids, torch.Tensor) or ids.ndim != 2:
        return None
    types = generate_kwargs.get(type_key) if type_key else None
    text = ids[(types == 0) if isinstance(types, torch.Tensor) else ~torch.isin(ids, torch.tensor(token_ids))]
    if not len(text):
        return None
    kwargs: dict[str, Any] = {}
    for key, value in generate_kwargs.items():
        if key == "input_ids" or key in _LOOP_KWARGS:
            continue
        if isinstance(value, torch.Tensor) and value.shape[:2] == ids.shape:  # per token: one more in front
            first = torch.ones_like(value[:, :1]) if key == "attention_mask" else torch.zeros_like(value[:, :1])
            value = torch.cat([first, value], dim=1)
        kwargs[key] = value
    kwargs.setdefault("attention_mask", torch.ones(ids.shape[0], ids.shape[1] + 1, dtype=torch.long))
    moved = torch.cat([torch.full_like(ids[:, :1], int(text[0])), ids], dim=1)
    # The hook records per-prompt state (rope_deltas) on the model: keep the caller's.
    saved = {m: m.rope_deltas for m in model.modules() if hasattr(m, "rope_deltas")}
    try:
        with torch.no_grad():
            positions = hook(moved, kwargs)
    except Exception:  # a hook that needs more than the sample gives it: every axis is taken as relative
        return None
    finally:
        for module, value in saved.items():
            module.rope_deltas = value
    if not isinstance(positions, torch.Tensor) or positions.ndim != 3:
        return None
    return positions, moved, kwargs["attention_mask"], kwargs.get(type_key) if type_key else None


def _multimodal_positions(
    components: Components, model: torch.nn.Module, generate_kwargs: Mapping[str, Any]
) -> MultimodalPositions | None:
    """The template of 3-D prefill positions (`[4, batch, length]`, computed by generate), else None."""
    if "prefill" not in components:
        return None
    prefill = components["prefill"][1]
    position_ids, input_ids = prefill.get("position_ids"), prefill.get("input_ids")
    if not isinstance(position_ids, torch.Tensor) or position_ids.ndim != 3 or not isinstance(input_ids, torch.Tensor):
        return None
    types = prefill.get("mm_token_type_ids")
    config = getattr(model, "config", None)
    token_ids = [
        int(v)
        for name in ("image_token_id", "image_token_index", "video_token_id", "video_token_index", "audio_token_id")
        if isinstance(v := getattr(config, name, None), int)
    ]
    decode = components["decode"][1].get("position_ids") if "decode" in components else None
    type_key = "mm_token_type_ids" if isinstance(types, torch.Tensor) else None
    return derive_positions(
        position_ids,
        input_ids,
        prefill.get("attention_mask"),
        types if isinstance(types, torch.Tensor) else None,
        type_key,
        token_ids,
        decode,
        shifted=_shifted_positions(model, generate_kwargs, type_key, token_ids),
    )


def _decodes_full_sequence(components: Components) -> bool:
    """Whether the decode sample's tokens are the prefill's plus one (the whole sequence), not just the new one."""
    if "prefill" not in components or "decode" not in components:
        return False
    try:
        prefill, decode = _query_length(components["prefill"][1]), _query_length(components["decode"][1])
    except InputError:
        return False
    return decode > 1 and decode == prefill + 1


def _ids(value: Any) -> list[int]:
    """Token ids of a generation config field (None, one id or a list) as a plain list."""
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
