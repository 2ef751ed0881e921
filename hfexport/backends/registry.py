"""The backends, one descriptor each, in the order formats are listed everywhere (`--format`, tables, docs).

Adding a backend: its folder `hfexport/backends/<name>/` (the descriptor `BACKEND` in its `__init__.py`, its code
in modules named by layer: see docs/design-notes.md, "Backends") and its line here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from hfexport.backends.descriptor import Backend
from hfexport.core.errors import InputError

PACKAGES: tuple[str, ...] = (
    "hfexport.backends.dynamo",
    "hfexport.backends.onnx",
    "hfexport.backends.executorch",
    "hfexport.backends.openvino",
    "hfexport.backends.aoti",
)

BACKENDS: dict[str, Backend] = {}
for _package in PACKAGES:
    _backend: Backend = importlib.import_module(_package).BACKEND
    BACKENDS[_backend.name] = _backend


def names() -> tuple[str, ...]:
    """Every format name, in order."""
    return tuple(BACKENDS)


def find(name: object) -> Backend | None:
    """The backend of a format name (an `ExportFormat` too), or None."""
    return BACKENDS.get(str(name))


def backend(name: object) -> Backend:
    """The backend of a format name (an `ExportFormat` too); `InputError` naming the formats for any other."""
    found = find(name)
    if found is None:
        raise InputError(f"unknown export format {name!r}; formats: {', '.join(BACKENDS)}")
    return found


def backends() -> tuple[Backend, ...]:
    return tuple(BACKENDS.values())


def lazy_classes(module: str, role: str) -> Callable[[str], Any]:
    """A module `__getattr__` that gives the backends' classes of `role` ("config", "exporter") by their names,
    each imported from its backend's folder on first use (`hfexport.configs.OnnxConfig`)."""

    def __getattr__(name: str) -> Any:
        for each in BACKENDS.values():
            ref = getattr(each, role)
            if ref.attribute == name:
                return ref.load()
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
