"""The JSON form of a cache pytree context (a skeleton), and the check of one read back from a saved program.

A skeleton is nested tuples of a tag and its fields (`("O", class path, attributes)`, `("T",)` for a tensor
leaf, ...). `dump_context` writes it as JSON; `load_context` reads it back and refuses, before anything is
built from it, unknown tags or arities, dtypes and devices torch does not know, and classes that are not
transformers cache classes (`hfexport.core.cache_classes`).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from hfexport.core.cache_classes import CacheContextError, load_class, resolve_config_class

Skeleton = tuple[Any, ...]
SIMPLE = (int, float, bool, str, type(None))


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
    if tag == "V" and not isinstance(skeleton[1], SIMPLE):
        raise CacheContextError("a cache context holds a value that is not a plain scalar")
    elif tag == "D":
        try:
            torch.device(skeleton[1])
        except (RuntimeError, TypeError) as exc:
            raise CacheContextError(f"a cache context names the device {skeleton[1]!r}: {exc}") from None
    elif tag == "Y" and not isinstance(getattr(torch, str(skeleton[1]), None), torch.dtype):
        raise CacheContextError(f"a cache context names the dtype {skeleton[1]!r}, which torch does not have")
    elif tag == "C":
        load_class(skeleton[1])
    elif tag == "G":
        if not isinstance(skeleton[1], str) or not isinstance(skeleton[2], str):
            raise CacheContextError("a cache context has a malformed config")
        resolve_config_class(skeleton[1])
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
            if not isinstance(pair, tuple) or len(pair) != 2 or not isinstance(pair[0], SIMPLE):
                raise CacheContextError("a cache context has a malformed mapping entry")
            _check_skeleton(pair[1])
    elif tag == "O":
        load_class(skeleton[1])
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


def dump_context(skeleton: Skeleton) -> str:
    return json.dumps(_to_jsonable(skeleton))


def load_context(text: str) -> Skeleton:
    """A context read back from a saved program: checked before anything is built from it."""
    skeleton = _from_jsonable(json.loads(text))
    _check_skeleton(skeleton)
    return skeleton
