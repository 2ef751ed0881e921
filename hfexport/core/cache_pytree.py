"""Pytree support for transformers `Cache` objects, so caches can be inputs and outputs of an export.

One generic encoding serves every cache class (dynamic, static, sliding, linear-attention, encoder-decoder,
model-specific subclasses): the object's attributes are walked, tensors become leaves, and everything
else (ints, flags, devices, dtypes, classes, nested layers, lists and dicts of them) becomes a hashable
skeleton that is the pytree context. Two caches of the same layout give equal contexts, so
`ExportedProgram.module()` accepts a fresh cache of the shape it was exported with, and the skeleton
serialises to JSON so that `torch.export.load` can rebuild a `StaticCache` input.
"""

from __future__ import annotations

import contextlib
import json
import weakref
from typing import Any

import torch
from torch.utils import _pytree as pytree

from hfexport.core.cache_classes import (
    class_path,
    is_config,
    load_class,
    model_cache_classes,
    resolve_config_class,
)
from hfexport.core.cache_context import SIMPLE, Skeleton, dump_context, load_context


def _encode(obj: Any, path: str, leaves: list[torch.Tensor], keys: list[str]) -> Skeleton:
    # A SymInt appears when a layer keeps a Python int counter that the trace made symbolic and that is not one of
    # `_COUNTERS` (those are carried as the size of an empty leaf): it must be an output of the graph, not a
    # baked-in constant.
    if isinstance(obj, (torch.Tensor, torch.SymInt)):
        leaves.append(obj)
        keys.append(path)
        return ("T",)
    if isinstance(obj, SIMPLE):
        return ("V", obj)
    if isinstance(obj, torch.device):
        return ("D", str(obj))
    if isinstance(obj, torch.dtype):
        return ("Y", str(obj).removeprefix("torch."))
    if isinstance(obj, type):
        return ("C", class_path(obj))
    if is_config(obj):
        # A cache that keeps its model's config (xLSTM): the config as its JSON, rebuilt with the class's
        # `from_dict`; no tensor in it, and two caches of one config have equal contexts.
        return ("G", class_path(type(obj)), obj.to_json_string(use_diff=False))
    if isinstance(obj, (list, tuple)):
        items = tuple(_encode(v, f"{path}.{i}", leaves, keys) for i, v in enumerate(obj))
        return ("L" if isinstance(obj, list) else "U", items)
    if isinstance(obj, dict):
        if not all(isinstance(k, SIMPLE) for k in obj):
            raise TypeError(f"cache attribute {path} is a dict with non-simple keys")
        return ("M", tuple((k, _encode(v, f"{path}.{k}", leaves, keys)) for k, v in obj.items()))
    if isinstance(obj, torch.nn.Module) or not hasattr(obj, "__dict__"):
        raise TypeError(f"cache attribute {path} holds a {type(obj).__name__}, which a cache pytree cannot carry")
    # Sort the names only: TorchDynamo (strict export) cannot sort pairs that hold tensors.
    state = vars(obj)
    attrs = tuple(
        (name, _attribute(obj, name, f"{path}.{name}" if path else name, leaves, keys)) for name in sorted(state)
    )
    return ("O", class_path(type(obj)), attrs)


def _attribute(obj: Any, name: str, path: str, leaves: list[Any], keys: list[str]) -> Skeleton:
    state = vars(obj)
    return (
        _derived(state, name)
        or _derived_by_key(state, name)
        or _counter(obj, state, name, path, leaves, keys)
        or _encode(state[name], path, leaves, keys)
    )


# Layer attributes that record a size of one of the layer's own tensors. Kept as "the size of that axis"
# rather than as the number, so a cache of another batch or length has the same pytree context (an exported
# program then accepts it) and, while tracing, the attribute is the symbolic size: the static cache's
# length stays dynamic instead of being baked in through `max_cache_len`.
_DERIVED_SIZES: dict[str, tuple[str, int]] = {
    "max_cache_len": ("keys", -2),
    "batch_size": ("keys", 0),
    "max_batch_size": ("keys", 0),
    "num_heads": ("keys", 1),
    "k_head_dim": ("keys", -1),
    "v_head_dim": ("values", -1),
}

# Layer attributes that are dicts of Python-int counts, each the size of one axis of the tensor under the same key
# of another dict attribute. DeepSeek-V4's compressor caches (`DeepseekV4HCACache`, `DeepseekV4CSACache`) count
# the compressed entries emitted so far per compressor, `entry_count[name]`, and append those entries to
# `compressed_kv[name]` (`[batch, entries, dim]`) at the same time (`update_compressor_states`). As numbers in
# the context, each decode step that emitted an entry was another pytree, which the decode program refused
# ("Trying to flatten user inputs with exported input tree spec": `entry_count` 2 traced, 3 at the step); as
# "that axis of that tensor" the context is the same at every step and the count is the symbolic size.
_DERIVED_KEY_SIZES: dict[str, tuple[str, int]] = {"entry_count": ("compressed_kv", 1)}

# Layer attributes that are Python-int token counters (`cumulative_length` of sliding-window layers: every token
# seen, while the keys keep the last `window - 1`). Each is carried as the last axis of an empty `[0, count]`
# leaf: the context is the same at every step, so one decode graph serves the steps before, at and past the
# window, and while tracing the counter is that symbolic size (a graph input and output), not a number baked into
# the program. (Kept as "the keys' length" it matched only until the window was full; as a number, each step
# was another pytree that the decode program refused.)
_COUNTERS = frozenset({"cumulative_length"})
# The counter leaf's dtype: it holds no element, only its shape is read (int64: every runtime binds it).
COUNTER_DTYPE = torch.int64


# The counter leaves of live cache objects, by object and attribute. torch.export matches `dynamic_shapes` to
# the input leaves by identity, and the dynamo runtime hands a program the leaves it unflattened a cache from:
# flattening the same object twice must give the same tensor, not a fresh one each time.
_COUNTER_LEAVES: weakref.WeakKeyDictionary[Any, dict[str, torch.Tensor]] = weakref.WeakKeyDictionary()


def _counter(
    obj: Any, state: dict[str, Any], name: str, path: str, leaves: list[Any], keys: list[str]
) -> Skeleton | None:
    value = state[name]
    if name not in _COUNTERS or isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        return None
    known = _COUNTER_LEAVES.get(obj, {}).get(name)
    # The same count: by identity for a SymInt (comparing would add a guard), by value for a number.
    if known is not None and (known.shape[-1] is value or (isinstance(value, int) and known.shape[-1] == value)):
        leaf = known
    else:
        # `zeros`, not `empty` (it has no element either way): ExecuTorch's dim-order pass rewrites `empty` to
        # `_empty_dim_order(int[] size)`, which turned the symbolic count into an int and guarded the sequence
        # axis to the sample's length (mistral, gemma3_text: the program took only the sample's 8 tokens). The
        # leaf is made again on every retrace (the outputs are flattened by this function), so no graph rule can
        # replace it before that pass.
        leaf = torch.zeros((0, value), dtype=COUNTER_DTYPE)
        _remember_counter(obj, name, leaf)
    leaves.append(leaf)
    keys.append(path)
    return ("N",)


def _remember_counter(obj: Any, name: str, leaf: torch.Tensor) -> None:
    # An object that cannot be weakly referenced gets a fresh leaf each time.
    with contextlib.suppress(TypeError):
        _COUNTER_LEAVES.setdefault(obj, {})[name] = leaf


def _derived(state: dict[str, Any], name: str) -> Skeleton | None:
    source = _DERIVED_SIZES.get(name)
    if source is None:
        return None
    tensor = state.get(source[0])
    value = state[name]
    if not isinstance(tensor, torch.Tensor) or tensor.ndim < 2 or isinstance(value, bool):
        return None
    if not isinstance(value, (int, torch.SymInt)):
        return None
    return ("S", source[0], source[1]) if _is_size(value, tensor.shape[source[1]]) else None


def _is_size(value: Any, size: Any) -> bool:
    if isinstance(value, int) and isinstance(size, int):
        return value == size
    # Symbolic while tracing: equal only when provably so, without adding a guard.
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(value == size))


def _derived_by_key(state: dict[str, Any], name: str) -> Skeleton | None:
    """A dict of counts kept as "the size of that axis of the same key's tensor" (`_DERIVED_KEY_SIZES`): a
    mapping of `K` nodes, and `V` nodes for the plain numbers without a tensor (a compressor that emitted
    nothing yet keeps `None` and 0). None when no count is such a size, or when a symbolic count is not one."""
    source = _DERIVED_KEY_SIZES.get(name)
    counts, tensors = state[name], state.get(source[0]) if source else None
    if source is None or not isinstance(counts, dict) or not isinstance(tensors, dict):
        return None
    items: list[tuple[Any, Skeleton]] = []
    for key, value in counts.items():
        tensor = tensors.get(key)
        if not isinstance(key, SIMPLE) or isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
            return None
        if isinstance(tensor, torch.Tensor) and tensor.ndim > source[1] and _is_size(value, tensor.shape[source[1]]):
            items.append((key, ("K", source[0], source[1])))
        elif isinstance(value, int):
            items.append((key, ("V", value)))
        else:
            return None
    return ("M", tuple(items)) if any(item[1][0] == "K" for item in items) else None


def _counter_of(leaf: Any) -> Any:
    """The counter an `N` leaf carries (its last axis), or None for a placeholder leaf without one: executorch's
    emitter unflattens the program's output spec with dummy `0` leaves only to describe the containers."""
    shape = getattr(leaf, "shape", ())
    return shape[-1] if len(shape) else None


def _decode(skeleton: Skeleton, leaves: list[Any]) -> Any:
    tag = skeleton[0]
    if tag == "T":
        return leaves.pop()
    if tag == "N":
        return _counter_of(leaves.pop())
    if tag == "V":
        return skeleton[1]
    if tag == "D":
        return torch.device(skeleton[1])
    if tag == "Y":
        return getattr(torch, skeleton[1])
    if tag == "C":
        return load_class(skeleton[1])
    if tag == "G":
        return resolve_config_class(skeleton[1]).from_dict(json.loads(skeleton[2]))
    if tag in ("L", "U"):
        items = [_decode(s, leaves) for s in skeleton[1]]
        return items if tag == "L" else tuple(items)
    if tag == "M":
        return {k: _decode(s, leaves) for k, s in skeleton[1]}
    cls = load_class(skeleton[1])
    obj = cls.__new__(cls)
    sized, sized_by_key = [], []
    for name, sub in skeleton[2]:
        if sub[0] == "S":
            sized.append((name, sub))
            continue
        if sub[0] == "M" and any(item[1][0] == "K" for item in sub[1]):
            sized_by_key.append((name, sub))  # K and V nodes only: no leaf is skipped by deciding it later
            continue
        if sub[0] == "N":
            leaf = leaves.pop()
            if isinstance(leaf, torch.Tensor):
                _remember_counter(obj, name, leaf)
            object.__setattr__(obj, name, _counter_of(leaf))
            continue
        object.__setattr__(obj, name, _decode(sub, leaves))
    for name, (_, tensor_name, axis) in sized:
        shape = getattr(getattr(obj, tensor_name, None), "shape", ())
        # Placeholder leaves (empty tensors used to name a spec's leaves) have no such axis.
        object.__setattr__(obj, name, shape[axis] if -len(shape) <= axis < len(shape) else None)
    for name, (_, items) in sized_by_key:
        counts = {}
        for key, sub in items:
            if sub[0] != "K":
                counts[key] = _decode(sub, leaves)
                continue
            tensor = (getattr(obj, sub[1], None) or {}).get(key)
            shape = getattr(tensor, "shape", ())
            counts[key] = shape[sub[2]] if -len(shape) <= sub[2] < len(shape) else None
        object.__setattr__(obj, name, counts)
    return obj


def flatten_cache(cache: Any) -> tuple[list[torch.Tensor], Skeleton]:
    leaves: list[torch.Tensor] = []
    skeleton = _encode(cache, "", leaves, [])
    return leaves, skeleton


def _flatten_with_keys(cache: Any) -> tuple[list[tuple[Any, torch.Tensor]], Skeleton]:
    leaves: list[torch.Tensor] = []
    keys: list[str] = []
    skeleton = _encode(cache, "", leaves, keys)
    return [(pytree.GetAttrKey(k.replace(".", "_")), v) for k, v in zip(keys, leaves, strict=True)], skeleton


def unflatten_cache(values: Any, skeleton: Skeleton) -> Any:
    # _decode pops from the end, so hand it the leaves reversed.
    return _decode(skeleton, list(values)[::-1])


def register_pytree_node(cls: type) -> bool:
    """Register a `Cache` subclass as a pytree node (idempotent). Returns True when `cls` was newly registered.

    The one call a fresh process needs before `torch.export.load` of an hfexport program, e.g.
    `register_pytree_node(StaticCache)`: it also makes every other type such a program's specs name
    deserialisable — transformers' model-output classes and every imported cache class (cache layers included).
    """
    newly = _register_cache_class(cls)
    register_program_types()
    return newly


def register_program_types() -> None:
    """Make the types hfexport programs name in their pytree specs known: model outputs and cache classes."""
    # ModelOutput subclasses register themselves as pytree nodes when their module is imported; the MoE module
    # defines the `transformers::grouped_mm_fallback` op a Dynamo MoE program calls.
    import transformers.integrations.moe
    import transformers.modeling_outputs  # noqa: F401

    register_cache_pytrees()


def _register_cache_class(cls: type) -> bool:
    if cls in pytree.SUPPORTED_NODES:
        return False
    pytree.register_pytree_node(
        cls,
        flatten_cache,
        unflatten_cache,
        serialized_type_name=f"{cls.__module__}.{cls.__qualname__}",
        to_dumpable_context=dump_context,
        from_dumpable_context=load_context,
        flatten_with_keys_fn=_flatten_with_keys,
    )
    return True


def register_cache_pytrees(*extra: type) -> list[type]:
    """Register every imported `Cache` subclass, every model-defined cache class of an imported modeling module
    (`is_model_cache_class`) and `extra` classes; return the ones newly registered."""
    from transformers.cache_utils import Cache

    seen: list[type] = []
    stack: list[type] = [Cache, *model_cache_classes(), *extra]
    while stack:
        cls = stack.pop()
        if cls in seen:
            continue
        seen.append(cls)
        stack.extend(cls.__subclasses__())
    return [cls for cls in seen if _register_cache_class(cls)]


def cache_dynamic_shapes(cache: Any, dim_for_tensor: Any) -> list[Any]:
    """The `dynamic_shapes` entry for a cache input: one spec per tensor leaf, in flatten order.

    The heads and head-dim axes of 4-D attention keys/values (`[batch, heads, length, head_dim]`) are model
    constants and stay static: a cross-attention cache is read by sdpa without a concat that would tie them to
    the query's static heads, and torch.onnx's sdpa translation then refuses symbolic kv heads ("SDPA (MHA)
    requires q_num_heads = kv_num_heads").
    """
    leaves: list[torch.Tensor] = []
    keys: list[str] = []
    _encode(cache, "", leaves, keys)
    specs = []
    for key, tensor in zip(keys, leaves, strict=True):
        spec = dim_for_tensor(tensor)
        if key.endswith((".keys", ".values")) and tensor.ndim == 4 and isinstance(spec, dict):
            spec = {axis: dim for axis, dim in spec.items() if axis not in (1, 3)}
        specs.append(spec)
    return specs
