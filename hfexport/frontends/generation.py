"""Split a generative model into the components `generate` runs, with the real kwargs each one saw.

`decompose_for_generation` runs `model.generate` once on small sample inputs with forward pre-hooks on the
model and on the submodules generation drives, and snapshots (deep-copies) the kwargs of each call: the
cache a step receives is mutated in place by later steps, so a reference would show the final state.
No per-model glue: the components are found through transformers' own accessors.

| model | components |
|---|---|
| decoder-only, MoE, state-space | `prefill`, `decode` |
| encoder-decoder (T5, BART, Whisper) | `encoder`, `prefill`, `decode` |
| multimodal (LLaVA, Qwen2-VL) | `<modality>_encoder`, `multi_modal_projector`, `language_model`, `lm_head`, `decode` |

`multi_token_decode=True` records two decode steps and merges them into one call with two query tokens,
so a dynamic export keeps the query axis symbolic: one graph then serves a 1-token step, a block of
speculative tokens, and a prefill on an empty cache. The projector is a component only when the model has one.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from hfexport.errors import InputError
from hfexport.frontends.torch_export import scalar_sequence
from hfexport.generation_spec import LAYOUT_MAX_NUMEL, CacheLeaf, ComponentSpec, GenerationSpec, LayoutSpecialised
from hfexport.naming import canonical_output
from hfexport.positions import MultimodalPositions
from hfexport.positions import derive as derive_positions

Components = dict[str, tuple[torch.nn.Module, dict[str, Any]]]

# Submodule names under which multimodal models keep the projector from encoder features to text embeddings.
PROJECTOR_NAMES = ("multi_modal_projector", "connector", "embed_vision", "embed_audio")
MODALITIES = ("image", "audio")
# Kwargs of a generate call that are not model inputs (they configure the loop).
_LOOP_KWARGS = ("max_new_tokens", "min_new_tokens", "max_length", "min_length", "do_sample", "generation_config")


@dataclass
class _Recorder:
    """Forward pre-hooks that snapshot the kwargs of every call of the watched modules."""

    calls: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    handles: list[Any] = field(default_factory=list)

    def watch(self, name: str, module: torch.nn.Module) -> None:
        self.calls.setdefault(name, [])

        def record(_module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            recorded = dict(kwargs)
            if args:
                # Positional calls (a projector or lm_head called as `module(hidden)`) are named after the
                # forward signature, so the component can be exported with kwargs like any other.
                params = list(inspect.signature(_module.forward).parameters)
                recorded.update(zip(params, args, strict=False))
            self.calls[name].append(copy.deepcopy(recorded))

        self.handles.append(module.register_forward_pre_hook(record, with_kwargs=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


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


def _loop_config(model: torch.nn.Module, generation_config: Any, new_tokens: int) -> tuple[Any, dict[str, Any]]:
    from transformers import GenerationConfig

    base = generation_config if generation_config is not None else getattr(model, "generation_config", None)
    config = copy.deepcopy(base) if base is not None else GenerationConfig()
    # min_new_tokens: a random-weight model may emit EOS at once and end generation before a decode step.
    config.max_new_tokens = new_tokens
    config.min_new_tokens = new_tokens
    config.max_length = None
    config.do_sample = False
    config.num_beams = 1
    if config.pad_token_id is None:
        config.pad_token_id = config.eos_token_id if config.eos_token_id is not None else 0
    return config, {"generation_config": config}


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


def tensor_fields(value: Any) -> Any:
    """A ModelOutput (or a dict of them) with only its tensor-valued fields (tensors, nested sequences of them):
    the pytree an exported graph takes and returns for `mm_encoder_outputs` / `encoder_outputs`."""
    from transformers.utils import ModelOutput

    def tensors(v: Any) -> bool:
        # Nested sequences too: Qwen3-VL's deepstack_features is a list (per layer) of tuples (per image).
        return isinstance(v, torch.Tensor) or (isinstance(v, (tuple, list)) and bool(v) and all(map(tensors, v)))

    if isinstance(value, ModelOutput):
        return type(value)(**{k: v for k, v in value.items() if tensors(v)})
    if isinstance(value, Mapping):
        return {k: tensor_fields(v) for k, v in value.items()}
    return value


def _plain_inputs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Model outputs given as inputs (`encoder_outputs`) keep their class (a registered pytree node) with only
    their tensor fields: some forwards read `encoder_outputs.last_hidden_state` and cannot take a tuple."""
    from transformers.utils import ModelOutput

    out: dict[str, Any] = {}
    for name, value in kwargs.items():
        if isinstance(value, ModelOutput):
            value = type(value)(**{k: v for k, v in value.items() if isinstance(v, torch.Tensor)})
        elif name == "mm_encoder_outputs" and isinstance(value, Mapping):
            value = tensor_fields(dict(value))
        out[name] = value
    return out


def _query_length(call: Mapping[str, Any]) -> int:
    for key in ("input_ids", "decoder_input_ids", "inputs_embeds", "decoder_inputs_embeds"):
        value = call.get(key)
        if isinstance(value, torch.Tensor):
            return value.shape[1]
    raise InputError("a decode step has no input_ids / inputs_embeds to merge")


def merge_decode_calls(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """One call equivalent to two consecutive decode steps: the first step's cache, both steps' tokens.

    Per-token tensors are concatenated along their query axis; a 2-D attention mask (over past + current
    tokens) is the second step's, which covers both tokens; a 4-D mask (one row per query) stacks the rows.
    All logits are kept, so the graph can check a block of speculative tokens.
    """
    merged = dict(first)
    q = _query_length(first)
    for key, value in second.items():
        old = first.get(key)
        if not isinstance(value, torch.Tensor) or not isinstance(old, torch.Tensor):
            continue
        if key in ("attention_mask", "decoder_attention_mask") and value.ndim == 2:
            merged[key] = value
        elif key in ("attention_mask", "decoder_attention_mask") and value.ndim == 4:
            merged[key] = torch.cat([old, value], dim=2)
        elif old.ndim >= 2 and old.shape[1] == q and key not in ("encoder_outputs",):
            merged[key] = torch.cat([old, value], dim=1)
        elif old.ndim == 1 and old.shape[0] == q:  # cache_position
            merged[key] = torch.cat([old, value], dim=0)
    if "logits_to_keep" in merged:
        merged["logits_to_keep"] = 0
    return merged


def _empty_like_static(cache: Any) -> Any:
    """An initialised copy of a static cache, emptied: a prefill sample whose K/V buffers are allocated.

    generate allocates static layers lazily inside the first forward, so the prefill call sees unallocated
    layers, which torch.export cannot take as inputs; the decode step's cache has them allocated.
    """
    fresh = copy.deepcopy(cache)
    fresh.reset()
    return fresh


def _linear_only(cache: Any) -> bool:
    linear = getattr(cache, "is_linear", None)
    return bool(linear) and all(linear)


def _is_static(cache: Any) -> bool:
    """A fixed-length attention cache written in place (state-space layers are fixed-size, but have no length)."""
    layers = getattr(cache, "layers", None)
    if not layers or not all(getattr(layer, "is_compileable", False) for layer in layers):
        return False
    return any(getattr(layer, "get_max_length", lambda: -1)() > 0 for layer in layers)


def _cache_key(kwargs: Mapping[str, Any]) -> str | None:
    from transformers.cache_utils import Cache

    return next((k for k, v in kwargs.items() if isinstance(v, Cache)), None)


def _accepts(module: torch.nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return False


def restore_attention_mask(model: torch.nn.Module, call: dict[str, Any]) -> dict[str, Any]:
    """Give a decoder-only step the attention mask generate left out.

    generate drops an all-ones mask (a fast path), and a graph traced without one has no mask input, so a
    later padded batch would be wrong. The mask put back is the one generate builds for a padding-free
    batch: 2-D over past + current tokens, or, with a compileable (static) cache, the 4-D mask that
    `create_masks_for_generate` makes.
    """
    if call.get("attention_mask") is not None or not _accepts(model, "attention_mask"):
        return call
    tokens = next((call[k] for k in ("input_ids", "inputs_embeds") if isinstance(call.get(k), torch.Tensor)), None)
    if tokens is None:
        return call
    batch, query = tokens.shape[:2]
    cache_key = _cache_key(call)
    cache = call.get(cache_key) if cache_key else None
    # A state-space cache has no length: its models mask the current tokens only.
    past = int(cache.get_seq_length()) if cache is not None and not _linear_only(cache) else 0
    mask: Any = torch.ones((batch, past + query), dtype=torch.long, device=tokens.device)
    if cache is not None and cache.is_compileable and not all(cache.is_linear):
        from transformers.masking_utils import create_masks_for_generate

        make = getattr(model, "create_masks_for_generate", create_masks_for_generate)
        dtype = getattr(model, "dtype", torch.float32)
        mask = make(
            config=model.config,
            inputs_embeds=torch.empty((batch, query, 0), dtype=dtype, device=tokens.device),
            attention_mask=mask,
            cache=cache,
            position_ids=call.get("position_ids"),
        )
        if mask is None:
            # sdpa's is_causal fast path (no padding, empty cache) needs no mask; a graph input needs one.
            positions = call.get("position_ids")
            if not isinstance(positions, torch.Tensor):
                positions = torch.arange(past, past + query, device=tokens.device).expand(batch, query)
            length = max((layer.get_max_length() for layer in cache.layers), default=-1)
            slots = torch.arange(length if length > 0 else past + query, device=tokens.device)
            mask = (slots[None, None, None, :] <= positions[:, None, :, None]).contiguous()
    return {**call, "attention_mask": mask}


def decompose_for_generation(
    model: torch.nn.Module,
    generate_kwargs: Mapping[str, Any],
    generation_config: Any = None,
    multi_token_decode: bool = False,
) -> Components:
    """Run `model.generate` once (2 new tokens, 3 with `multi_token_decode`) and return its components.

    Returns `{name: (submodule, forward_kwargs)}`; see the module docstring for the names. The kwargs are
    snapshots of real calls, so `submodule(**forward_kwargs)` reproduces that step. The caller's model and
    `generate_kwargs` are left as they were.
    """
    if not hasattr(model, "generate"):
        raise InputError(f"{type(model).__name__} has no generate(); decompose_for_generation needs a generative model")
    if not isinstance(generate_kwargs, Mapping) or not generate_kwargs:
        raise InputError("generate_kwargs must be a non-empty mapping, e.g. a tokenizer's BatchEncoding")
    kwargs = {k: v for k, v in dict(generate_kwargs).items() if k not in _LOOP_KWARGS}
    ids = kwargs.get("input_ids")
    if isinstance(ids, torch.Tensor) and kwargs.get("attention_mask") is None:
        # With a mask in the sample, every graph takes one, so a later padded batch is handled.
        kwargs["attention_mask"] = torch.ones_like(ids)

    config = getattr(model, "config", None)
    is_encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
    parts = multimodal_parts(model)
    recorder = _Recorder()
    recorder.watch("model", model)
    if is_encoder_decoder and not parts:
        recorder.watch("encoder", model.get_encoder())
    for name, module in parts.items():
        recorder.watch(name, module)

    # An encoder-decoder's first decode step sees a self-attention cache of length 1, which torch.export would
    # specialise; its second step (length 2) is the decode sample.
    first_decode = 2 if is_encoder_decoder else 1
    steps = first_decode + (2 if multi_token_decode else 1)
    _, loop = _loop_config(model, generation_config, steps)
    try:
        with torch.no_grad():
            model.generate(**kwargs, **loop)
    finally:
        recorder.remove()

    calls = recorder.calls
    model_calls = calls["model"]
    if len(model_calls) < steps:
        raise InputError(
            f"{type(model).__name__}.generate ran its forward {len(model_calls)} times for {steps} new tokens; "
            "expected one call per token (prefill, then decode steps)"
        )
    prefill, decode = model_calls[0], model_calls[first_decode]
    if prefill.get("mm_encoder_outputs") == {}:
        # No separate modality encoder (Fuyu embeds image patches in its forward): generate hands the first
        # forward an empty dict, and the forward computes the features from its own inputs (image_patches).
        prefill = {k: v for k, v in prefill.items() if k != "mm_encoder_outputs"}
    after = model_calls[first_decode + 1] if multi_token_decode else None
    cache_key = _cache_key(decode)
    if cache_key is not None and _is_static(decode[cache_key]):
        prefill = {**prefill, cache_key: _empty_like_static(decode[cache_key])}
    if not is_encoder_decoder:
        prefill, decode = restore_attention_mask(model, prefill), restore_attention_mask(model, decode)
        after = restore_attention_mask(model, after) if after is not None else None
    if after is not None:
        decode = merge_decode_calls(decode, after)

    components: Components = {}
    if parts:
        for name in parts:
            if not calls.get(name):
                raise InputError(
                    f"generate never called {type(model).__name__}'s {name} ({type(parts[name]).__name__}); "
                    "pass the modality's inputs (e.g. pixel_values) in generate_kwargs"
                )
            call = calls[name][0]
            if name == "language_model":
                call = restore_attention_mask(parts[name], call)
            components[name] = (parts[name], _plain_inputs(call))
        # transformers 5.24's generate runs `base_model.get_<modality>_features` before the loop and hands
        # the result to the first forward as `mm_encoder_outputs`: that function (encoder, feature-layer
        # choice, projector) and the first forward (the merge at the image tokens, multimodal positions) are
        # exported as they are, so `hfexport.runtime.generate` needs no per-model glue.
        features = _modality_features(model, kwargs, prefill)
        for modality, (module, call) in features.items():
            components[f"{modality}_features"] = (module, call)
        # Without `get_<modality>_features` (Qwen2-Audio), the first forward takes the modality inputs itself
        # (input_features): it is the prefill all the same.
        components["prefill"] = (model, _plain_inputs(prefill))
    else:
        if is_encoder_decoder:
            if not calls.get("encoder"):
                raise InputError(f"generate never called {type(model).__name__}'s encoder")
            components["encoder"] = (model.get_encoder(), _plain_inputs(calls["encoder"][0]))
        # A model whose modality encoder `get_encoder(modality=...)` does not name (Emu3's VQ-VAE) still gets
        # its features from `get_<modality>_features` before the loop.
        for modality, (module, call) in _modality_features(model, kwargs, prefill).items():
            components[f"{modality}_features"] = (module, call)
        components["prefill"] = (model, _plain_inputs(prefill))
    components["decode"] = (model, _plain_inputs(decode))
    return components


def split_config(config: Any, names: list[str]) -> dict[str, Any]:
    """One config per component: the same one for all, or a dict that must name every component."""
    if isinstance(config, Mapping):
        missing = [n for n in names if n not in config]
        unknown = sorted(set(config) - set(names))
        if missing or unknown:
            raise InputError(
                f"the per-component config dict must name every component {names}: "
                + (f"missing {missing}" if missing else "")
                + ("; " if missing and unknown else "")
                + (f"unknown {unknown}" if unknown else "")
            )
        return {n: config[n] for n in names}
    return dict.fromkeys(names, config)


class GenerationComponents(dict):
    """`{component name: native program}`, as `export_for_generation` returns it, plus how to run them.

    `spec` (a `GenerationSpec`) and `samples` (the captured forward kwargs) let `hfexport.runtime.generate`
    drive the components without the source model.
    """

    spec: GenerationSpec
    samples: dict[str, dict[str, Any]]


def _leaves(value: Any, prefix: str) -> list[tuple[str, torch.Tensor]]:
    from hfexport.cache_pytree import register_cache_pytrees
    from hfexport.naming import leaf_names

    register_cache_pytrees()
    return [(n, t) for n, t in leaf_names({prefix: value}) if isinstance(t, torch.Tensor)]


def describe(
    components: Components,
    generation_config: Any,
    model: torch.nn.Module,
    multi_token_decode: bool,
    generate_kwargs: Mapping[str, Any] | None = None,
) -> GenerationSpec:
    """The `GenerationSpec` of decomposed components (sample shapes, constants, cache layout)."""
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
            current_only = current_only or _linear_only(cache)
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
