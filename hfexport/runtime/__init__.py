"""Runtimes: load and run exported artifacts like the source model, and `generate()` over exported components.

`hfexport.runtime.generate(components, input_ids, ...)` runs an `export_for_generation` result on its backend.
Names load lazily, so importing this package imports no backend.
"""

from __future__ import annotations

from hfexport.core._lazy import lazy_getattr

_EXPORTS = {
    "generate": "hfexport.runtime.generation",
    "prompt_logits": "hfexport.runtime.generation",
    "GenerationSpec": "hfexport.generation_spec",
    "RuntimeOptions": "hfexport.runtime.drivers.base",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_getattr("hfexport.runtime", _EXPORTS, globals())
