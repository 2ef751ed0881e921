"""Runtimes: load and run exported artifacts like the source model, and `generate()` over exported components.

`hfexport.runtime.generate(components, input_ids, ...)` runs an `export_for_generation` result on its backend.
Names load lazily, so importing this package imports no backend.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "generate": "hfexport.runtime.generation",
    "GenerationSpec": "hfexport.frontends.generation",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'hfexport.runtime' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
