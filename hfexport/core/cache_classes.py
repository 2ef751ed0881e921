"""Which classes a cache pytree context may name, and resolving them without importing anything else.

A context read from a saved program names classes (`module:Qualname`); `resolve_class` returns one only if it
is a transformers cache or cache-layer class (the classes of `transformers.cache_utils`, subclasses of its
abstract classes, and the cache classes modeling modules define on their own: `is_model_cache_class`), and
imports a module only when it is a module file of the installed transformers package.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import re
import sys
from pathlib import Path
from typing import Any

import torch


def class_path(cls: type) -> str:
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


def load_class(path: Any) -> type:
    if not isinstance(path, str):
        raise CacheContextError(f"a cache context names {path!r}, not a class path (module:Class)")
    return resolve_class(path)


@functools.lru_cache(maxsize=1024)  # the decoder runs at every call of a program; a refusal raises, so is not kept
def resolve_class(path: str) -> type:
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
        or class_path(obj) != path
        # A class of transformers' cache module itself, or a cache (layer) subclass elsewhere in transformers.
        # Not every layer class derives from the abstract ones: NemotronH's cache holds `DummyLayer`s.
        or not (obj in cache_module_classes() or issubclass(obj, roots) or is_model_cache_class(obj))
    ):
        raise CacheContextError(f"a cache context names {path!r}, which is not a transformers cache class")
    return obj


@functools.lru_cache(maxsize=256)
def resolve_config_class(path: str) -> type:
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
    if not isinstance(obj, type) or not issubclass(obj, PretrainedConfig) or class_path(obj) != path:
        raise CacheContextError(f"a cache context names {path!r}, which is not a transformers config class")
    return obj


def is_config(obj: Any) -> bool:
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


def model_cache_classes() -> list[type]:
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
