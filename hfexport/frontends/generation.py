"""Split a generative model into the components `generate` runs, with the real kwargs each one saw.

`decompose_for_generation` runs `model.generate` once on small sample inputs with forward pre-hooks on the
model and on the submodules generation drives, and snapshots (deep-copies) the kwargs of each call: the
cache a step receives is mutated in place by later steps, so a reference would show the final state.
No per-model glue: the components are found through transformers' own accessors.

| model | components | on `.runtime` |
|---|---|---|
| decoder-only, MoE, state-space | `prefill`, `decode` | |
| encoder-decoder (T5, BART, Whisper) | `encoder`, `prefill`, `decode` | |
| LLaVA | `image_encoder`, `multi_modal_projector`, `language_model`, `lm_head`, `decode` | `image_features`,`prefill` |
| Qwen2-VL (its projector is in the tower) | `image_encoder`, `language_model`, `lm_head`, `decode` | the same |

The returned dict holds the documented components only (the seed's contract), each a submodule called as
`generate` calls it. `hfexport.runtime.generate` drives a multimodal model through two more programs, kept
outside the dict on `.runtime`: `<modality>_features` (`get_<modality>_features`: the encoder, the
feature-layer choice and the projector, as transformers runs them before the loop) and `prefill` (the first
forward, which merges those features at the image tokens); the seams between the documented components
(feature layer, merge, multimodal positions) are model code that the caller of the documented components owns.

`multi_token_decode=True` records two decode steps and merges them into one call with two query tokens,
so a dynamic export keeps the query axis symbolic: one graph then serves a 1-token step, a block of
speculative tokens, and a prefill on an empty cache. The projector is a component only when the model has one.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from hfexport.core.errors import InputError
from hfexport.frontends.calls import (
    _LOOP_KWARGS,
    CACHE_INPUT,
    Components,
    FixedArguments,
    LayerTypeMasks,
    _cache_key,
    _empty_like_static,
    _is_static,
    _plain_inputs,
    graph_call,
    layer_type_masks,
    merge_decode_calls,
    restore_attention_mask,
    tensor_fields,
)
from hfexport.frontends.describe import GenerationComponents, describe
from hfexport.frontends.multimodal import ModalityFeatures, _modality_features, multimodal_parts, specialise_layouts

__all__ = [
    "CACHE_INPUT",
    "Decomposition",
    "FixedArguments",
    "GenerationComponents",
    "ModalityFeatures",
    "decompose_for_generation",
    "describe",
    "merge_decode_calls",
    "multimodal_parts",
    "restore_attention_mask",
    "runtime_config_source",
    "runtime_configs",
    "specialise_layouts",
    "split_config",
    "tensor_fields",
]


class Decomposition(dict):
    """`{name: (submodule, forward_kwargs)}` of the documented components, as `decompose_for_generation`
    returns them; `runtime` holds the pairs `hfexport.runtime.generate` runs beyond them (a multimodal model's
    `<modality>_features` and `prefill`), in the same form. `all()` is both, in export order."""

    runtime: Components
    # The layout inputs baked into modality components (`specialise_layouts`), by component and input name.
    layouts: dict[str, dict[str, list[Any]]]

    def __init__(
        self, components: Components, runtime: Components, layouts: dict[str, dict[str, list[Any]]] | None = None
    ) -> None:
        super().__init__(components)
        self.runtime = dict(runtime)
        self.layouts = dict(layouts or {})

    def all(self) -> Components:
        return {**self, **self.runtime}


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


def decompose_for_generation(
    model: torch.nn.Module,
    generate_kwargs: Mapping[str, Any],
    generation_config: Any = None,
    multi_token_decode: bool = False,
    *,
    rules: Any = None,
) -> Decomposition:
    """Run `model.generate` once (2 new tokens, 3 with `multi_token_decode`) and return its components.

    Returns `{name: (submodule, forward_kwargs)}` (a `Decomposition`: the runtime components on `.runtime`);
    see the module docstring for the names. Each pair exports as it is (`exporter.export(submodule, kwargs)`):
    a modality component's layout inputs (`image_grid_thw`...) are baked into it (`specialise_layouts`; the
    values on `.layouts`), so its kwargs hold the other inputs only. The kwargs are
    snapshots of real calls, so `submodule(**forward_kwargs)` reproduces that step. They hold tensors and the
    cache only, in graph order (`input_ids`, `attention_mask`, `position_ids`, other tensors, then the cache
    as `past_key_values`); the call's Python arguments (`use_cache`, `return_dict`...) are fixed in the
    submodule (`FixedArguments`), with `logits_to_keep=0`: every query position's logits. The caller's model
    and `generate_kwargs` are left as they were. `rules` (a `RuleSelection`, the export's) decides which patch
    rules marked `records` run during that generate (`hfexport.rewrites.engine.recording`).
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
    from hfexport.rewrites import engine

    try:
        # Under the patch rules that carry module-kept state in the cache (`records`), so the samples hold it.
        with torch.no_grad(), engine.recording(model, rules):
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
    masks: dict[str, LayerTypeMasks | None] = {}
    if not is_encoder_decoder:
        prefill, decode = restore_attention_mask(model, prefill), restore_attention_mask(model, decode)
        after = restore_attention_mask(model, after) if after is not None else None
        # A static cache's masks by layer type (sliding windows) become the one mask the loop builds.
        prefill, masks["prefill"] = layer_type_masks(model, prefill)
        decode, masks["decode"] = layer_type_masks(model, decode)
        if after is not None:
            after, after_masks = layer_type_masks(model, after)
            if after_masks != masks["decode"]:
                raise InputError(f"{type(model).__name__}'s two decode steps take masks of different layer types")
    if after is not None:
        decode = merge_decode_calls(decode, after)

    components: Components = {}
    runtime: Components = {}
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
        # exported as they are, so `hfexport.runtime.generate` needs no per-model glue. Neither is one of the
        # documented components: they are runtime components.
        for modality, (module, call) in _modality_features(model, kwargs, prefill).items():
            runtime[f"{modality}_features"] = (module, call)
        # Without `get_<modality>_features` (Qwen2-Audio), the first forward takes the modality inputs itself
        # (input_features): it is the prefill all the same.
        runtime["prefill"] = (model, _plain_inputs(prefill))
    else:
        if is_encoder_decoder:
            if not calls.get("encoder"):
                raise InputError(f"generate never called {type(model).__name__}'s encoder")
            components["encoder"] = (model.get_encoder(), _plain_inputs(calls["encoder"][0]))
        # A model whose modality encoder `get_encoder(modality=...)` does not name (Emu3's VQ-VAE) still gets
        # its features from `get_<modality>_features` before the loop.
        for modality, (module, call) in _modality_features(model, kwargs, prefill).items():
            runtime[f"{modality}_features"] = (module, call)
        components["prefill"] = (model, _plain_inputs(prefill))
    components["decode"] = (model, _plain_inputs(decode))
    # Every graph takes tensors and the cache only, in one order; generate's Python arguments are fixed inside.
    documented, layouts = specialise_layouts(
        {name: graph_call(m, call, masks.get(name)) for name, (m, call) in components.items()}
    )
    extra, extra_layouts = specialise_layouts({name: graph_call(m, call) for name, (m, call) in runtime.items()})
    return Decomposition(documented, extra, {**layouts, **extra_layouts})


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


def runtime_config_source(name: str, names: list[str]) -> str:
    """The documented component whose config the runtime component `name` is exported with: a modality's
    features take its encoder's (else the prefill's), the multimodal `prefill` the decode step's (the same
    forward), so a per-component config dict names the documented components only."""
    if name.endswith("_features"):
        encoder = name.removesuffix("_features") + "_encoder"
        if encoder in names:
            return encoder
    return "prefill" if "prefill" in names and name != "prefill" else "decode"


def runtime_configs(configs: Mapping[str, Any], names: list[str], per_component: bool) -> dict[str, Any]:
    """The config each runtime component in `names` is exported with: its source's (`runtime_config_source`)
    among the documented `configs`. In a per-component dict a quantizer's `calibration_dataset` holds the
    source's forward kwargs, which are not this component's: the copy calibrates on its own sample instead."""
    out: dict[str, Any] = {}
    for name in names:
        each = configs[runtime_config_source(name, list(configs))]
        quantizer = getattr(each, "quantizer", None)
        if per_component and getattr(quantizer, "calibration_dataset", None) is not None:
            quantizer = copy.copy(quantizer)
            quantizer.calibration_dataset = None
            each = dataclasses.replace(each, quantizer=quantizer)
        out[name] = each
    return out
