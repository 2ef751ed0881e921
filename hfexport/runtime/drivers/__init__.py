"""The runtime of each export format, looked up by format name: `backend("onnx")` -> its `Runtime`.

Each backend's runtime (its generation driver, and how a saved component of it is opened and run) is in its folder,
`hfexport/backends/<name>/driver.py`, named by its descriptor; looking one up imports no other backend's package.
"""

from __future__ import annotations

from hfexport.backends.registry import backend as descriptor
from hfexport.runtime.drivers.base import Driver, Runtime, RuntimeOptions, Step

__all__ = ["Driver", "Runtime", "RuntimeOptions", "Step", "backend"]


def backend(export_format: str) -> Runtime:
    """The runtime of a format name (`hfexport.formats.format_of` gives the name of a native object)."""
    found: Runtime = descriptor(export_format).runtime.load()
    return found
