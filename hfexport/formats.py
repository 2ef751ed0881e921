"""The export formats and what is known of each without importing its backend, read from the backends' descriptors.

`ExportFormat` has one member per backend (`hfexport.backends.registry`); `format_of` finds the format of a native
object from its type. Every module that must tell formats apart asks the descriptor (`hfexport.backends.backend`)
instead of its own if/elif over names.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from enum import Enum
from typing import Any

from hfexport.backends.registry import backends, names


class _FormatEnum(str, Enum):
    """A format name that prints as itself (`str(ExportFormat.ONNX) == "onnx"`)."""

    def __str__(self) -> str:
        return str(self.value)


# One member per backend: `ExportFormat.DYNAMO`, `ExportFormat.ONNX`, ..., `ExportFormat.AOTI`.
ExportFormat = _FormatEnum("ExportFormat", {name.upper(): name for name in names()}, module=__name__)  # type: ignore[misc]


@dataclass(frozen=True)
class FormatInfo:
    """One format: its name, the file a saved component is loaded from, and the native type it exports."""

    name: str
    main_file: str
    native_type: str  # for messages; detection is `format_of`
    # Files beside the main one that belong to it (ONNX external data, OpenVINO weights).
    side_suffixes: tuple[str, ...] = ()


FORMAT_TABLE: dict[str, FormatInfo] = {
    b.name: FormatInfo(b.name, b.main_file, b.native_type, b.side_suffixes) for b in backends()
}
FORMATS: tuple[str, ...] = names()
MAIN_FILE: dict[str, str] = {b.name: b.main_file for b in backends()}


def format_of(program: Any) -> str:
    """The format of a native export object, found from its type without importing any backend package.

    A class is checked only when its module is imported already (an object of it exists only then). Raises
    `TypeError` for anything an exporter does not return.
    """
    for each in backends():
        for native in each.native_classes:
            module, _, name = native.partition(":")
            cls: Any = sys.modules.get(module)
            for part in name.split(".") if cls is not None else ():
                cls = getattr(cls, part, None)
            if isinstance(cls, type) and isinstance(program, cls):
                return each.name
    natives = ", ".join(b.native_type for b in backends())
    kind = type(program)
    raise TypeError(f"a {kind.__module__}.{kind.__name__} is not an export of any format (expected one of: {natives})")
