"""What a patch rule's `covers(module, scope)` (read by `hfexport scan`) looks up: a class's own method."""

from __future__ import annotations

import importlib
import types


def class_method_at(module: str, scope: str, method: str) -> types.FunctionType | None:
    """The function `method` defined on the class `scope` names (`Class.method`) in `module`, else None.

    A scope that is not `<Class>.<method>` at the module's top level, a module that cannot be imported (a file
    scanned by path) and a method the class inherits all give None: those are no class the rule can see.
    """
    owner, _, name = scope.rpartition(".")
    if name != method or not owner or "." in owner:
        return None
    try:
        cls = getattr(importlib.import_module(module), owner, None)
    except Exception:  # a file scanned by path that is not importable
        return None
    function = getattr(cls, "__dict__", {}).get(method)
    return function if isinstance(function, types.FunctionType) else None
