"""The recorded calls of a generation: what one component call looks like, merged, with its mask restored."""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hfexport.core.errors import InputError
from hfexport.naming import CACHE_ALIASES

Components = dict[str, tuple[torch.nn.Module, dict[str, Any]]]


# Kwargs of a generate call that are not model inputs (they configure the loop).
_LOOP_KWARGS = ("max_new_tokens", "min_new_tokens", "max_length", "min_length", "do_sample", "generation_config")

# The name every generation graph gives its cache input, whatever the forward calls it (`cache` in transformers
# 5.24, `cache_params` in older state-space models): the seed's decode loops pass `past_key_values=` and read
# `example_inputs[1]["past_key_values"]`, the name transformers' forwards still accept.
CACHE_INPUT = "past_key_values"
# Graph inputs come in this order: the tokens, the mask, the positions, other tensors, then the cache (the
# ExecuTorch method's inputs are `[input_ids, attention_mask, position_ids, cache x N]`, bound by index).
_TOKEN_INPUTS = ("input_ids", "inputs_embeds", "decoder_input_ids", "decoder_inputs_embeds")
_LEADING_INPUTS = (*_TOKEN_INPUTS, "attention_mask", "decoder_attention_mask", "position_ids", "decoder_position_ids")
# generate asks for the last position's logits only in prefill; every graph returns all of them instead, so one
# decode graph serves a whole prompt and a block of speculative tokens (the runtime takes `[:, -1]`).
_LOGITS_TO_KEEP = ("logits_to_keep", "num_logits_to_keep")


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


class FixedArguments(torch.nn.Module):
    """A component called with its Python-valued arguments (`use_cache=True`, `return_dict=True`,
    `logits_to_keep=0`...) fixed, and its cache kwarg taken as `past_key_values`.

    Exported as it is, a forward's Python arguments stay in the program's input spec: `ExportedProgram.module()`
    refuses a call without them ("kwarg keyword mismatch") and an ExecuTorch method keeps them as non-tensor
    inputs. Fixed here, every graph takes tensors and the cache only. A module, not a flag of the capture, so the
    `(submodule, kwargs)` pairs of `decompose_for_generation` reproduce the step with the graph's own inputs.

    Attributes the wrapper lacks (`config`, `generation_config`, `dtype`...) are the inner module's, so the
    capture and the rules read the model's own; `fixed_arguments` names the class after the inner one, so
    reports and errors name the real model class.
    """

    def __init__(
        self,
        inner: torch.nn.Module,
        fixed: Mapping[str, Any],
        cache_key: str | None,
        masks: LayerTypeMasks | None = None,
    ) -> None:
        super().__init__()
        self.inner = inner
        self.fixed = dict(fixed)
        self.cache_key = cache_key
        # The graph takes one 4-D mask over the static cache's slots; the forward gets generate's masks from it.
        self.masks = masks
        # The inner module's mode, without `train()`, which would set every submodule's.
        self.training = inner.training

    def forward(self, **kwargs: Any) -> Any:
        if self.cache_key is not None and CACHE_INPUT in kwargs:
            kwargs[self.cache_key] = kwargs.pop(CACHE_INPUT)
        cache = kwargs.get(self.cache_key) if self.cache_key is not None else None
        if cache is not None and not _is_static(cache) and not _tracing():
            # The exported program of a growing cache returns the grown cache and leaves its input as it was; an
            # eager call does the same. Otherwise the seed's "sanity-check the eager forward before exporting"
            # would grow the recorded sample in place, and the export after it would trace a later step.
            kwargs[self.cache_key] = copy.deepcopy(cache)
        if self.masks is not None and isinstance(kwargs.get("attention_mask"), torch.Tensor):
            kwargs["attention_mask"] = self.masks.build(kwargs["attention_mask"])
        out = self.inner(**kwargs, **self.fixed)
        if cache is not None and not _is_static(cache):
            out = _with_cache(out, kwargs[self.cache_key])
        return out

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "inner" or name.startswith("__"):
                raise
            return getattr(self.inner, name)


def _with_cache(out: Any, cache: Any) -> Any:
    """`out` with the growing cache the forward was handed, where the forward wrote into it but returns none.

    BERT-style decoders built with `is_decoder=False` (bert, roberta, bert-generation... as causal LMs) set
    `use_cache=False`, yet their layers still append the step to a cache they are given, and generate reads it
    in place on the next step. An exported graph is functional: a cache it does not return is lost, and the
    next step would get the empty one. Returning it gives the graph the same step the eager loop sees.
    """
    from transformers.cache_utils import Cache
    from transformers.utils import ModelOutput

    if not isinstance(out, ModelOutput) or any(isinstance(v, Cache) for v in out.values()):
        return out
    field_name = _cache_field(out)
    if field_name is None:
        return _with_past(out, cache)
    out[field_name] = cache
    return out


def _cache_field(output: Any) -> str | None:
    """The field of a model-output dataclass (or class) that holds the cache, if it has one."""
    names = {f.name for f in dataclasses.fields(output)}
    return next((n for n in ("cache", "past_key_values") if n in names), None)


def _with_past(out: Any, cache: Any) -> Any:
    """`out` as transformers' `<Output>WithPast` class holding `cache`, for an output class without a cache field.

    RecurrentGemma's causal LM returns a `CausalLMOutput` (no cache field) and generate carries the cache it handed
    the forward, written in place, to the next step; the graph must return it. The `WithPast` twin has every field
    of the output plus the cache (`cache` in transformers 5.24); without one the output is left as it is.
    """
    import transformers.modeling_outputs as outputs

    twin = getattr(outputs, f"{type(out).__name__}WithPast", None)
    if twin is None or not dataclasses.is_dataclass(twin):
        return out
    field_name = _cache_field(twin)
    twin_fields = {f.name for f in dataclasses.fields(twin)}
    if field_name is None or not {f.name for f in dataclasses.fields(out)} <= twin_fields:
        return out
    return twin(**dict(out.items()), **{field_name: cache})


_NAMED_WRAPPERS: dict[type, type] = {}


def fixed_arguments(
    module: torch.nn.Module, fixed: Mapping[str, Any], cache_key: str | None, masks: LayerTypeMasks | None = None
) -> FixedArguments:
    """`FixedArguments(module, ...)` whose class is named like `module`'s (a subclass made once per class)."""
    cls = type(module)
    named = _NAMED_WRAPPERS.get(cls)
    if named is None:
        named = type(cls.__name__, (FixedArguments,), {"__qualname__": cls.__qualname__, "__module__": __name__})
        _NAMED_WRAPPERS[cls] = named
    return named(module, fixed, cache_key, masks)


@dataclass(frozen=True)
class LayerTypeMasks:
    """How a static-cache step's forward gets the masks generate hands it, from the one 4-D mask the graph takes.

    With a compileable cache, generate builds the masks itself (`create_masks_for_generate`) and hands the forward
    a dict by layer type (`{"full_attention": ..., "sliding_attention": ...}`) or, for a model whose every layer
    slides (Mistral), one tensor with the window in it. A graph traced on that call took one input per layer type
    (`attention_mask.sliding_attention`), which the generation loop does not have: it builds one 4-D mask over the
    cache slots, causal and with the padding off (`hfexport.runtime.generation`). The graph takes that mask, and
    this rebuilds generate's from it, inside the graph: a sliding layer's keeps the slots within `window` of the
    query's own slot, which is the last one its row attends (a query attends itself; a padding query's row is all
    off, as are its sliding ones). `kinds` holds (layer type, window) pairs, layer type None for a single tensor;
    `dtype` is generate's (bool for sdpa, an additive float mask for eager attention).
    """

    kinds: tuple[tuple[str | None, int | None], ...]
    dtype: torch.dtype

    def build(self, mask: torch.Tensor) -> Any:
        mask = mask.bool()
        slots = torch.arange(mask.shape[-1], device=mask.device)
        built: dict[str | None, torch.Tensor] = {}
        for kind, window in self.kinds:
            each = mask
            if window is not None:
                own = torch.where(mask, slots, -1).amax(-1, keepdim=True)  # the query's slot
                each = mask & (slots > own - window)
            if self.dtype != torch.bool:
                each = torch.zeros(each.shape, dtype=self.dtype, device=each.device).masked_fill(
                    ~each, torch.finfo(self.dtype).min
                )
            built[kind] = each
        return built.get(None, built)


def layer_type_masks(model: torch.nn.Module, call: dict[str, Any]) -> tuple[dict[str, Any], LayerTypeMasks | None]:
    """A static-cache step whose mask holds a sliding window (a dict by layer type, or one tensor with the window):
    the call with the one 4-D mask the generation loop builds instead, and how the forward gets generate's masks
    back (`LayerTypeMasks`). Other calls are returned as they are, with None.
    """
    recorded = call.get("attention_mask")
    cache_key = _cache_key(call)
    if cache_key is None or not _is_static(call[cache_key]):
        return call, None
    config = getattr(model, "config", None)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    window = getattr(text, "sliding_window", None)
    if isinstance(recorded, Mapping):
        masks = {k: v for k, v in recorded.items() if v is not None}
        if not masks or not all(isinstance(v, torch.Tensor) and v.ndim == 4 for v in masks.values()):
            return call, None
        unknown = sorted(set(masks) - {"full_attention", "sliding_attention"})
        if unknown:
            raise InputError(
                f"{type(model).__name__}'s static-cache step takes masks for layer types {unknown}, which the "
                "generation loop cannot build yet (only full_attention and sliding_attention)"
            )
        kinds = tuple((k, window if k == "sliding_attention" else None) for k in masks)
    elif isinstance(recorded, torch.Tensor) and recorded.ndim == 4 and isinstance(window, int):
        masks = {None: recorded}
        kinds = ((None, window),)
    else:
        return call, None
    if any(kind == "sliding_attention" for kind, _ in kinds) and not isinstance(window, int):
        raise InputError(f"{type(model).__name__}'s config has sliding_attention layers but no sliding_window")
    first = masks.get("full_attention", next(iter(masks.values())))
    dtype = first.dtype
    plain = first if dtype == torch.bool else first == 0
    plan = LayerTypeMasks(kinds, dtype)
    built = plan.build(plain)
    rebuilt = built if isinstance(built, dict) else {None: built}
    for kind, value in masks.items():
        if rebuilt[kind].shape != value.shape or not torch.equal(rebuilt[kind], value):
            raise InputError(
                f"{type(model).__name__}'s {kind or 'attention'} mask of the recorded step is not the sliding-window "
                "mask of one 4-D causal mask over the cache slots: its generate builds masks the loop cannot"
            )
    return {**call, "attention_mask": plain.contiguous()}, plan


def _is_model_cache(value: Any) -> bool:
    """A model-defined cache object (`core.cache_pytree.is_model_cache_class`), a pytree node like a `Cache`."""
    from hfexport.core.cache_classes import is_model_cache_class

    return is_model_cache_class(type(value))


def _graph_input(value: Any) -> bool:
    """A tensor, a cache, or a pytree of tensors (`encoder_outputs`, `mm_encoder_outputs`): a graph input."""
    from transformers.cache_utils import Cache

    if isinstance(value, (torch.Tensor, Cache)):
        return True
    if not isinstance(value, (tuple, list, Mapping)):
        return False
    leaves = torch.utils._pytree.tree_leaves(value)
    return bool(leaves) and all(isinstance(leaf, torch.Tensor) for leaf in leaves)


def graph_call(
    module: torch.nn.Module, kwargs: Mapping[str, Any], masks: LayerTypeMasks | None = None
) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The component to export for one recorded call: tensor inputs (the cache as `past_key_values`) in graph
    order, with every Python-valued argument fixed in a `FixedArguments` wrapper (`logits_to_keep` as 0), and
    generate's masks by layer type rebuilt from the one mask the graph takes (`masks`, see `layer_type_masks`)."""
    key = _cache_key(kwargs)
    inputs = {k: v for k, v in kwargs.items() if k == key or _graph_input(v)}
    fixed = {k: (0 if k in _LOGITS_TO_KEEP else v) for k, v in kwargs.items() if k not in inputs}
    order = [k for k in _LEADING_INPUTS if k in inputs]
    order += [k for k in inputs if k not in _LEADING_INPUTS and k != key]
    order += [key] if key is not None else []
    ordered = {(CACHE_INPUT if k == key else k): inputs[k] for k in order}
    # A growing cache is always wrapped: the wrapper's eager call leaves it as it was (`FixedArguments.forward`).
    if masks is None and not fixed and (key is None or (key == CACHE_INPUT and _is_static(inputs[key]))):
        return module, ordered
    return fixed_arguments(module, fixed, key, masks), ordered


def same_graph(first: tuple[torch.nn.Module, dict[str, Any]], second: tuple[torch.nn.Module, dict[str, Any]]) -> bool:
    """Whether two recorded calls trace to one graph when every axis is dynamic: the same module (or the same
    module behind equal fixed arguments), and inputs of one pytree structure whose tensors agree in dtype, rank
    and in which axes have size 0 or 1 (`torch.export` specialises those, so a size-1 axis in one sample and not
    the other would make the graphs differ)."""
    import torch.utils._pytree as pytree

    (module_a, kwargs_a), (module_b, kwargs_b) = first, second
    if module_a is not module_b:
        if not (isinstance(module_a, FixedArguments) and isinstance(module_b, FixedArguments)):
            return False
        if module_a.inner is not module_b.inner or module_a.cache_key != module_b.cache_key:
            return False
        if module_a.masks != module_b.masks:
            return False
        plain = (bool, int, float, str, type(None))
        fixed_a, fixed_b = module_a.fixed, module_b.fixed
        values = [*fixed_a.values(), *fixed_b.values()]
        if fixed_a.keys() != fixed_b.keys() or not all(isinstance(v, plain) for v in values):
            return False
        if any(type(fixed_a[k]) is not type(fixed_b[k]) or fixed_a[k] != fixed_b[k] for k in fixed_a):
            return False
    leaves_a, spec_a = pytree.tree_flatten(kwargs_a)
    leaves_b, spec_b = pytree.tree_flatten(kwargs_b)
    if spec_a != spec_b:
        return False
    for a, b in zip(leaves_a, leaves_b, strict=True):
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            return False
        if not isinstance(a, torch.Tensor):
            if type(a) is not type(b) or a != b:
                return False
            continue
        if a.dtype != b.dtype or a.ndim != b.ndim:
            return False
        if [size if size < 2 else 2 for size in a.shape] != [size if size < 2 else 2 for size in b.shape]:
            return False
    return True


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


def _tracing() -> bool:
    return bool(torch.compiler.is_compiling() or torch.compiler.is_exporting())


def _is_static(cache: Any) -> bool:
    """A fixed-length attention cache written in place (state-space layers are fixed-size, but have no length)."""
    layers = getattr(cache, "layers", None)
    if not layers or not all(getattr(layer, "is_compileable", False) for layer in layers):
        return False
    return any(getattr(layer, "get_max_length", lambda: -1)() > 0 for layer in layers)


def _cache_key(kwargs: Mapping[str, Any]) -> str | None:
    """The kwarg that is the cache: a transformers `Cache` or a cache class a modeling module defines outside
    `Cache`'s hierarchy (xLSTM's `xLSTMCache`, Reformer's `ReformerDynamicCache`: `is_model_cache_class`; before,
    xLSTM's decode step fixed the recorded cache object as a Python argument, so the decode graph held the
    sample's recurrent state as constants that its forward mutates), else a recurrent state kept as a list of
    tensors under a cache name (RWKV's `state`; `past_key_values` once `graph_call` renamed it), which generate
    carries from one step's output to the next step as it does a `Cache`."""
    from transformers.cache_utils import Cache

    key = next((k for k, v in kwargs.items() if isinstance(v, Cache)), None)
    if key is None:
        # Only without a transformers Cache: a model's own padding caches (Kyutai's, Voxtral realtime's...) that
        # ride along with `past_key_values` stay what they were.
        key = next((k for k, v in kwargs.items() if _is_model_cache(v)), None)
    if key is None:
        key = next((k for k, v in kwargs.items() if k in CACHE_ALIASES and _tensor_list(v)), None)
    return key


def _tensor_list(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(t, torch.Tensor) for t in value)


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
    given = call.get("attention_mask")
    by_type_skipped = isinstance(given, Mapping) and any(v is None for v in given.values())
    if (given is not None and not by_type_skipped) or not _accepts(model, "attention_mask"):
        return call
    tokens = next((call[k] for k in ("input_ids", "inputs_embeds") if isinstance(call.get(k), torch.Tensor)), None)
    if tokens is None:
        return call
    batch, query = tokens.shape[:2]
    cache_key = _cache_key(call)
    cache = call.get(cache_key) if cache_key else None
    # A state-space cache, or a recurrent state kept as a list of tensors (RWKV), has no length: its models mask
    # the current tokens only.
    has_length = cache is not None and hasattr(cache, "get_seq_length") and not _linear_only(cache)
    # Reformer's own cache answers None for a step without buckets yet: no past length, as for no cache.
    length = cache.get_seq_length() if has_length else None
    past = int(length) if length is not None else 0
    mask: Any = torch.ones((batch, past + query), dtype=torch.long, device=tokens.device)
    if by_type_skipped:
        mask = given  # generate's masks by layer type, where sdpa's fast path left some out: filled in below
    elif cache is not None and getattr(cache, "is_compileable", False) and not all(cache.is_linear):
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
    skipped = mask is None or (isinstance(mask, Mapping) and any(v is None for v in mask.values()))
    if cache is not None and skipped:
        # sdpa's is_causal fast path (no padding, empty cache) needs no mask; a graph input needs one. By layer
        # type (exaone4: `{"sliding_attention": None}`), each such mask is this one: `layer_type_masks` checks it.
        positions = call.get("position_ids")
        if not isinstance(positions, torch.Tensor):
            positions = torch.arange(past, past + query, device=tokens.device).expand(batch, query)
        length = max((layer.get_max_length() for layer in cache.layers), default=-1)
        slots = torch.arange(length if length > 0 else past + query, device=tokens.device)
        causal = (slots[None, None, None, :] <= positions[:, None, :, None]).contiguous()
        mask = causal if mask is None else {k: causal if v is None else v for k, v in mask.items()}
    return {**call, "attention_mask": mask}
