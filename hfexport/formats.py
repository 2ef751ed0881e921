"""The four export formats and what is known of each without importing its backend: one table.

Every module that must tell formats apart (saving, loading, the runtimes, the command line) reads this
table or calls `format_of`, instead of its own if/elif over type names.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from enum import Enum
from typing import Any


class ExportFormat(str, Enum):
    DYNAMO = "dynamo"
    ONNX = "onnx"
    EXECUTORCH = "executorch"
    OPENVINO = "openvino"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class FormatInfo:
    """One format: its name, the file a saved component is loaded from, and the native type it exports."""

    name: str
    main_file: str
    native_type: str  # for messages; detection is `format_of`
    # Files beside the main one that belong to it (ONNX external data, OpenVINO weights).
    side_suffixes: tuple[str, ...] = ()


FORMAT_TABLE: dict[str, FormatInfo] = {
    "dynamo": FormatInfo("dynamo", "model.pt2", "torch.export.ExportedProgram"),
    "onnx": FormatInfo("onnx", "model.onnx", "torch.onnx.ONNXProgram", (".data",)),
    "executorch": FormatInfo("executorch", "model.pte", "executorch.exir.ExecutorchProgramManager"),
    "openvino": FormatInfo("openvino", "model.xml", "openvino.Model", (".bin",)),
}
FORMATS: tuple[str, ...] = tuple(FORMAT_TABLE)
MAIN_FILE: dict[str, str] = {name: info.main_file for name, info in FORMAT_TABLE.items()}


def format_of(program: Any) -> str:
    """The format of a native export object, found from its type without importing any backend package.

    Raises `TypeError` for anything an exporter does not return.
    """
    cls = type(program)
    module, name = cls.__module__, cls.__name__
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(program, torch.export.ExportedProgram):
        return "dynamo"
    if torch is not None and isinstance(program, torch.onnx.ONNXProgram):
        return "onnx"
    if module.startswith("executorch.") and name == "ExecutorchProgramManager":
        return "executorch"
    openvino = sys.modules.get("openvino")
    if openvino is not None and isinstance(program, (openvino.Model, openvino.CompiledModel)):
        return "openvino"
    natives = ", ".join(info.native_type for info in FORMAT_TABLE.values())
    raise TypeError(f"a {module}.{name} is not an export of any format (expected one of: {natives})")
