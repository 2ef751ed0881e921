"""One backend per export format, looked up by format name: `backend("onnx")` -> its `Backend`.

Each `hfexport.runtime.drivers.<format>` module holds that format's generation driver and how a saved
component of it is opened and run. The table is keyed by the names of `hfexport.formats.FORMATS`; a module
is imported on first use, so looking one backend up imports no other backend's package.
"""

from __future__ import annotations

import importlib

from hfexport.errors import InputError
from hfexport.runtime.drivers.base import Backend, Driver, RuntimeOptions, Step

__all__ = ["BACKEND_MODULES", "Backend", "Driver", "RuntimeOptions", "Step", "backend"]

BACKEND_MODULES: dict[str, str] = {
    "dynamo": "hfexport.runtime.drivers.dynamo",
    "onnx": "hfexport.runtime.drivers.onnx",
    "executorch": "hfexport.runtime.drivers.executorch",
    "openvino": "hfexport.runtime.drivers.openvino",
}


def backend(export_format: str) -> Backend:
    """The backend of a format name (`hfexport.formats.format_of` gives the name of a native object)."""
    module = BACKEND_MODULES.get(str(export_format))
    if module is None:
        raise InputError(f"no runtime for the format {export_format!r}; formats: {list(BACKEND_MODULES)}")
    return importlib.import_module(module).BACKEND
