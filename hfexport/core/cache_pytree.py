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
import functools
import importlib
import importlib.util
import json
import re
import sys
import weakref
from pathlib import Path
from typing import Any

import torch
from torch.utils import _pytree as pytree

Skeleton = tuple[Any, ...]
_SIMPLE = (int, float, bool, str, type(None))


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


class CacheContextError(ValueError):
    """A cache pytree context (from a saved program) that is malformed or names a class that is not a cache's."""


# The only modules a context may make us import: transformers' cache module and its models' modeling modules.
_IMPORTABLE = re.compile(r"^transformers\.(cache_utils|models\.\w+\.modeling_\w+)$")
# ... and, for a config a cache holds (xLSTM's `xLSTMCache.config`), its models' configuration modules.
_CONFIG_MODULE = re.compile(r"^transformers\.models\.\w+\.configuration_\w+$")


@functools.cache
def cache_module_classes() -> tuple[type, ...]:
    """The classes `transformers.cache_utils` defines: its caches, cache layers and their bases."""
    import inspect

    import transformers.cache_utils as cache_utils

    return tuple(
        cls for _, cls in inspect.getmembers(cache_utils, inspect.isclass) if cls.__module__ == cache_utils.__name__
    )


@functools.cache
def _cache_roots() -> tuple[type, ...]:
    """The base classes of every cache and cache layer: the abstract classes `transformers.cache_utils` defines."""
    import inspect

    import transformers.cache_utils as cache_utils

    return tuple(cls for cls in cache_module_classes() if cls is cache_utils.Cache or inspect.isabstract(cls))


def _load_class(path: Any) -> type:
    if not isinstance(path, str):
        raise CacheContextError(f"a cache context names {path!r}, not a class path (module:Class)")
    return _resolve_class(path)


@functools.lru_cache(maxsize=1024)  # the decoder runs at every call of a program; a refusal raises, so is not kept
def _resolve_class(path: str) -> type:
    """The class a context names, only if it is a transformers cache or cache-layer class (an allow-list built
    from the installed transformers: the classes of `transformers.cache_utils` and subclasses of its abstract
    classes).

    A module is imported only when it is transformers' own cache module or a modeling module of the installed
    transformers package; nothing else a saved file names is ever imported, whatever the trust flag.
    """
    if path.count(":") != 1:
        raise CacheContextError(f"a cache context names {path!r}, not a class path (module:Class)")
    module_name, qualname = path.split(":")
    if module_name not in sys.modules:
        if not _IMPORTABLE.match(module_name) or not _in_transformers(module_name):
            raise CacheContextError(f"a cache context names {path!r}, which is not a transformers cache class")
        importlib.import_module(module_name)
    obj: Any = sys.modules[module_name]
    for part in qualname.split("."):
        obj = getattr(obj, part, None) if part.isidentifier() and not part.startswith("__") else None
    roots = _cache_roots()
    if (
        not isinstance(obj, type)
        or not module_name.startswith("transformers.")
        or _class_path(obj) != path
        # A class of transformers' cache module itself, or a cache (layer) subclass elsewhere in transformers.
        # Not every layer class derives from the abstract ones: NemotronH's cache holds `DummyLayer`s.
        or not (obj in cache_module_classes() or issubclass(obj, roots) or is_model_cache_class(obj))
    ):
        raise CacheContextError(f"a cache context names {path!r}, which is not a transformers cache class")
    return obj


@functools.lru_cache(maxsize=256)
def _resolve_config_class(path: str) -> type:
    """The config class a context names (a cache that holds its model's config: xLSTM's `xLSTMCache`), only if it
    is a `PretrainedConfig` subclass that a configuration module of the installed transformers defines."""
    from transformers import PretrainedConfig

    module_name, _, qualname = path.partition(":")
    if not _CONFIG_MODULE.match(module_name) or not qualname.isidentifier():
        raise CacheContextError(f"a cache context names {path!r}, which is not a transformers config class")
    if module_name not in sys.modules:
        if not _in_transformers(module_name):
            raise CacheContextError(f"a cache context names {path!r}, which is not a transformers config class")
        importlib.import_module(module_name)
    obj = getattr(sys.modules[module_name], qualname, None)
    if not isinstance(obj, type) or not issubclass(obj, PretrainedConfig) or _class_path(obj) != path:
        raise CacheContextError(f"a cache context names {path!r}, which is not a transformers config class")
    return obj


def _is_config(obj: Any) -> bool:
    config = sys.modules.get("transformers.configuration_utils")
    return config is not None and isinstance(obj, config.PretrainedConfig)


_MODELING = re.compile(r"^transformers\.models\.\w+\.modeling_\w+$")


def is_model_cache_class(cls: type) -> bool:
    """A cache class a modeling module defines on its own, outside `Cache`'s hierarchy.

    Reformer's `ReformerDynamicCache` (past buckets and states) and xLSTM's `xLSTMCache` are plain objects a
    forward returns with its outputs; torch.export refuses them ("Found <class ...> in output, which is not a
    known type") unless they are pytree nodes. The generic attribute walk encodes them as it does `Cache`s.
    Recognised by structure: a class (not a module) named `...Cache` that a transformers modeling module defines.
    """
    return (
        isinstance(cls, type)
        and cls.__name__.endswith("Cache")
        and _MODELING.match(cls.__module__) is not None
        and not issubclass(cls, torch.nn.Module)
        and sys.modules.get(cls.__module__) is not None
        and getattr(sys.modules[cls.__module__], cls.__name__, None) is cls
    )


# Modeling modules already searched for cache classes: `register_cache_pytrees` runs before every trace and
# program call, and a module's classes do not change once imported.
_SEARCHED: dict[str, list[type]] = {}


def _model_cache_classes() -> list[type]:
    """The model-defined cache classes (`is_model_cache_class`) of every modeling module imported so far."""
    for name, module in list(sys.modules.items()):
        if name in _SEARCHED or module is None or _MODELING.match(name) is None:
            continue
        _SEARCHED[name] = [
            value
            for value in list(vars(module).values())
            if isinstance(value, type) and value.__module__ == name and is_model_cache_class(value)
        ]
    return [cls for classes in _SEARCHED.values() for cls in classes]


def _in_transformers(module_name: str) -> bool:
    """Whether `module_name` is a module file of the installed transformers package (found, not run)."""
    import transformers

    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return False
    root = Path(transformers.__file__).resolve().parent
    return spec is not None and spec.origin is not None and Path(spec.origin).resolve().is_relative_to(root)


def _encode(obj: Any, path: str, leaves: list[torch.Tensor], keys: list[str]) -> Skeleton:
    # A SymInt appears when a layer keeps a Python int counter that the trace made symbolic and that is not one of
    # `_COUNTERS` (those are carried as the size of an empty leaf): it must be an output of the graph, not a
    # baked-in constant.
    if isinstance(obj, (torch.Tensor, torch.SymInt)):
        leaves.append(obj)
        keys.append(path)
        return ("T",)
    if isinstance(obj, _SIMPLE):
        return ("V", obj)
    if isinstance(obj, torch.device):
        return ("D", str(obj))
    if isinstance(obj, torch.dtype):
        return ("Y", str(obj).removeprefix("torch."))
    if isinstance(obj, type):
        return ("C", _class_path(obj))
    if _is_config(obj):
        # A cache that keeps its model's config (xLSTM): the config as its JSON, rebuilt with the class's
        # `from_dict`; no tensor in it, and two caches of one config have equal contexts.
        return ("G", _class_path(type(obj)), obj.to_json_string(use_diff=False))
    if isinstance(obj, (list, tuple)):
        items = tuple(_encode(v, f"{path}.{i}", leaves, keys) for i, v in enumerate(obj))
        return ("L" if isinstance(obj, list) else "U", items)
    if isinstance(obj, dict):
        if not all(isinstance(k, _SIMPLE) for k in obj):
            raise TypeError(f"cache attribute {path} is a dict with non-simple keys")
        return ("M", tuple((k, _encode(v, f"{path}.{k}", leaves, keys)) for k, v in obj.items()))
    if isinstance(obj, torch.nn.Module) or not hasattr(obj, "__dict__"):
        raise TypeError(f"cache attribute {path} holds a {type(obj).__name__}, which a cache pytree cannot carry")
    # Sort the names only: TorchDynamo (strict export) cannot sort pairs that hold tensors.
    state = vars(obj)
    attrs = tuple(
        (name, _attribute(obj, name, f"{path}.{name}" if path else name, leaves, keys)) for name in sorted(state)
    )
    return ("O", _class_path(type(obj)), attrs)


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
        if not isinstance(key, _SIMPLE) or isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
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
        return _load_class(skeleton[1])
    if tag == "G":
        return _resolve_config_class(skeleton[1]).from_dict(json.loads(skeleton[2]))
    if tag in ("L", "U"):
        items = [_decode(s, leaves) for s in skeleton[1]]
        return items if tag == "L" else tuple(items)
    if tag == "M":
        return {k: _decode(s, leaves) for k, s in skeleton[1]}
    cls = _load_class(skeleton[1])
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


def _to_jsonable(skeleton: Any) -> Any:
    if isinstance(skeleton, tuple):
        return {"t": [_to_jsonable(s) for s in skeleton]}
    return skeleton


def _from_jsonable(data: Any, depth: int = 0) -> Any:
    if depth > _MAX_CONTEXT_DEPTH:
        raise CacheContextError(f"a cache context is nested deeper than {_MAX_CONTEXT_DEPTH} levels")
    if isinstance(data, dict):
        if set(data) != {"t"} or not isinstance(data["t"], list):
            raise CacheContextError(f"a cache context has the object {sorted(data)!r}, not a node")
        return tuple(_from_jsonable(s, depth + 1) for s in data["t"])
    if isinstance(data, list):
        raise CacheContextError("a cache context has a bare list")
    return data


_MAX_CONTEXT_DEPTH = 64
# tag: (number of fields after the tag, what they are)
_ARITY = {"T": 0, "N": 0, "V": 1, "D": 1, "Y": 1, "C": 1, "L": 1, "U": 1, "M": 1, "O": 2, "S": 2, "K": 2, "G": 2}


def _check_skeleton(skeleton: Any) -> None:
    """A skeleton read from a file: known tags of the right arity, dtypes and devices torch knows, and classes
    that are transformers cache classes (resolved now, so a bad program is refused when it is loaded)."""
    if not isinstance(skeleton, tuple) or not skeleton or _ARITY.get(skeleton[0]) != len(skeleton) - 1:
        raise CacheContextError(f"a cache context has the node {str(skeleton)[:80]}, which is not one of ours")
    tag = skeleton[0]
    if tag == "V" and not isinstance(skeleton[1], _SIMPLE):
        raise CacheContextError("a cache context holds a value that is not a plain scalar")
    elif tag == "D":
        try:
            torch.device(skeleton[1])
        except (RuntimeError, TypeError) as exc:
            raise CacheContextError(f"a cache context names the device {skeleton[1]!r}: {exc}") from None
    elif tag == "Y" and not isinstance(getattr(torch, str(skeleton[1]), None), torch.dtype):
        raise CacheContextError(f"a cache context names the dtype {skeleton[1]!r}, which torch does not have")
    elif tag == "C":
        _load_class(skeleton[1])
    elif tag == "G":
        if not isinstance(skeleton[1], str) or not isinstance(skeleton[2], str):
            raise CacheContextError("a cache context has a malformed config")
        _resolve_config_class(skeleton[1])
        try:
            if not isinstance(json.loads(skeleton[2]), dict):
                raise ValueError("not an object")
        except ValueError as exc:
            raise CacheContextError(f"a cache context holds a config that is not a JSON object: {exc}") from None
    elif tag in ("L", "U"):
        for item in _items(skeleton[1]):
            _check_skeleton(item)
    elif tag == "M":
        for pair in _items(skeleton[1]):
            if not isinstance(pair, tuple) or len(pair) != 2 or not isinstance(pair[0], _SIMPLE):
                raise CacheContextError("a cache context has a malformed mapping entry")
            _check_skeleton(pair[1])
    elif tag == "O":
        _load_class(skeleton[1])
        for pair in _items(skeleton[2]):
            if not isinstance(pair, tuple) or len(pair) != 2 or not isinstance(pair[0], str):
                raise CacheContextError("a cache context has a malformed attribute")
            if not pair[0].isidentifier() or pair[0].startswith("__"):
                raise CacheContextError(f"a cache context sets the attribute {pair[0]!r}")
            _check_skeleton(pair[1])
    elif tag in ("S", "K") and (not isinstance(skeleton[1], str) or not isinstance(skeleton[2], int)):
        raise CacheContextError("a cache context has a malformed size reference")


def _items(value: Any) -> tuple[Any, ...]:
    if not isinstance(value, tuple):
        raise CacheContextError("a cache context has a malformed node")
    return value


def _dump_context(skeleton: Skeleton) -> str:
    return json.dumps(_to_jsonable(skeleton))


def _load_context(text: str) -> Skeleton:
    """A context read back from a saved program: checked before anything is built from it."""
    skeleton = _from_jsonable(json.loads(text))
    _check_skeleton(skeleton)
    return skeleton


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
        to_dumpable_context=_dump_context,
        from_dumpable_context=_load_context,
        flatten_with_keys_fn=_flatten_with_keys,
    )
    return True


def register_cache_pytrees(*extra: type) -> list[type]:
    """Register every imported `Cache` subclass, every model-defined cache class of an imported modeling module
    (`is_model_cache_class`) and `extra` classes; return the ones newly registered."""
    from transformers.cache_utils import Cache

    seen: list[type] = []
    stack: list[type] = [Cache, *_model_cache_classes(), *extra]
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
