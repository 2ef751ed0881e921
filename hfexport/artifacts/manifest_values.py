"""Checks of a manifest's JSON values: plain data within bounds, objects of a record's keys, and never code.

`check_plain` refuses anything but JSON's own types nested at most `MAX_DEPTH` deep and keys that serialisers use
to build objects; `count_values` counts values up to `MAX_VALUES` with no other work; `check_no_code` refuses
strings shaped like an import path of an importable module (`os.system`, `builtins:eval`), looking up at most
`MAX_CODE_LOOKUPS` top-level names on sys.path; `check_keys` refuses an object whose keys are not those of a
dataclass. `hfexport.artifacts.manifest` applies them to the whole manifest.
"""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from typing import Any

from hfexport.artifacts.errors import ManifestError

MAX_DEPTH = 32
MAX_VALUES = 200_000  # JSON values (objects, lists, strings, numbers) in the whole manifest
MAX_FILES = 10_000
# Distinct top-level names looked up on sys.path by the code-name check (each lookup reads folders).
MAX_CODE_LOOKUPS = 256

# `os.system`, `builtins:eval`, `subprocess.Popen`: the shape of a reference to a Python object.
_IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*(?::[A-Za-z_][\w.]*)?$")
_FILE_SUFFIXES = {"onnx", "data", "pte", "pt2", "xml", "bin", "json", "safetensors", "txt", "csv", "html", "png"}
# Keys that serialisers (pickle-alikes, jsonpickle, Hydra) use to make data build objects.
_CODE_KEYS = ("_target_", "py/object", "py/reduce", "py/function", "py/type", "!!python")


def count_values(value: Any) -> int:
    """The number of JSON values in `value`, stopping one past MAX_VALUES (no per-value work but counting)."""
    count = 0
    stack = [value]
    while stack and count <= MAX_VALUES:
        item = stack.pop()
        count += 1
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count


def check_plain(value: Any, where: str, depth: int = 0) -> None:
    """Only JSON's own types, nested at most MAX_DEPTH deep, with no object-building keys."""
    if depth > MAX_DEPTH:
        raise ManifestError(f"{where} is nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ManifestError(f"{where} has a non-string key {key!r}")
            if key.startswith("__") or key in _CODE_KEYS or key.startswith("!!python"):
                raise ManifestError(f"{where} has the key {key!r}, which names code; a manifest is plain data")
            check_plain(item, f"{where}.{key}", depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]", depth + 1)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ManifestError(f"{where} is {value}, not a finite number")
    elif value is not None and not isinstance(value, (str, int, bool)):
        raise ManifestError(f"{where} is a {type(value).__name__}, not plain JSON data")


def _importable(top: str) -> bool:
    if top in sys.stdlib_module_names or top in sys.builtin_module_names or top in sys.modules:
        return True
    try:
        # A top-level name is looked up on sys.path without running any code.
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return False


class Lookups:
    """The code-name check's sys.path lookups of one manifest: each top-level name once, at most MAX_CODE_LOOKUPS."""

    def __init__(self) -> None:
        self.found: dict[str, bool] = {}

    def importable(self, top: str) -> bool:
        if top not in self.found:
            if len(self.found) >= MAX_CODE_LOOKUPS:
                raise ManifestError(
                    f"the manifest holds more than {MAX_CODE_LOOKUPS} distinct names shaped like import paths "
                    "(`name.attr`); a manifest names files and fields, not code"
                )
            self.found[top] = _importable(top)
        return self.found[top]


def check_no_code(value: Any, where: str, lookups: Lookups | None = None) -> None:
    """Refuse strings shaped like an import path of an importable module (`os.system`, `builtins:eval`)."""
    lookups = lookups if lookups is not None else Lookups()
    if isinstance(value, dict):
        for key, item in value.items():
            check_no_code(item, f"{where}.{key}", lookups)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            check_no_code(item, f"{where}[{i}]", lookups)
    elif isinstance(value, str) and ("." in value or ":" in value) and _IMPORT_PATH.match(value):
        if value.rsplit(".", 1)[-1] in _FILE_SUFFIXES:
            return  # `model.onnx` is a file name, even where a module `model` happens to be importable
        top = re.split(r"[.:]", value, maxsplit=1)[0]
        if lookups.importable(top):
            raise ManifestError(
                f"{where} is {value!r}, the name of Python code; a manifest holds data, and loading never "
                "imports or calls what it names"
            )


def check_type(value: Any, types: tuple[type, ...], where: str) -> None:
    # bool is an int in Python: a `true` where a number belongs is still a schema error.
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
        raise ManifestError(f"{where} must be {names}, got {type(value).__name__}")


def _dataclass_keys(cls: Any, required: bool = False) -> set[str]:
    import dataclasses

    fields = dataclasses.fields(cls)
    if required:
        return {f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    return {f.name for f in fields}


def check_keys(data: Any, cls: Any, where: str) -> None:
    if not isinstance(data, dict):
        raise ManifestError(f"{where} must be an object")
    missing = sorted(_dataclass_keys(cls, required=True) - set(data))
    unknown = sorted(set(data) - _dataclass_keys(cls))
    if missing or unknown:
        raise ManifestError(f"{where}: missing key(s) {missing}, unknown key(s) {unknown} (a {cls.__name__})")
