"""Save a whole export to a folder and load it back, runnable, without trusting what is in the folder.

    hfexport.save(exported, "out/", config=config, report=exporter.report)   # one native object
    hfexport.save({"prefill": ep1, "decode": ep2}, "out/")                  # one per component
    loaded = hfexport.load("out/")                                          # trust=True for a .pt2
    outputs = loaded.run(inputs)              # {output name: tensor}, in the artifact's own runtime

Layout: a single export keeps its files at the top of the folder (`model.onnx`, `model.onnx.data`,
`report.json`, `manifest.json`); a dict of components gives each its own subfolder (`decode/model.pte`).

| format | files | written by | run by |
|---|---|---|---|
| dynamo | `model.pt2` | `torch.export.save` | `hfexport.load_program(...).module()` (needs `trust=True`) |
| onnx | `model.onnx` (+ `model.onnx.data`) | `ONNXProgram.save` | ONNX Runtime, fed by `onnx_feed` |
| executorch | `model.pte` | `ExecutorchProgramManager.save` | `hfexport.runtime.executorch.ExecutorchProgram` |
| openvino | `model.xml` + `model.bin` | `openvino.save_model` | `hfexport.runtime.openvino.OpenVINORunner` |

Saving is atomic: everything is written into a temporary folder beside the destination, flushed, then
renamed into place (an existing artifact is swapped out in one `renameat2(RENAME_EXCHANGE)` where the
filesystem has it). A save killed at any point leaves the destination absent or the previous artifact
whole; the next save into the same place removes the dead save's temporary folder.

The manifest is data, never code. Loading picks the runtime from a fixed table keyed by `format`; it
never imports or calls anything the manifest names. The loader refuses, before it opens any model file:
a manifest that is not a JSON object of the documented schema (unknown keys included), a file path that
is absolute, has `..` or escapes the folder through a symlink, a file whose size or sha256 differs from
the manifest (a truncated or swapped file), a config key that is not a field of the format's config, and
a string in the config or metadata shaped like an import path of an importable module (`os.system`).
A `.pt2` is a zip with pickled parts: it loads only with `trust=True`.
"""

from __future__ import annotations

import ctypes
import datetime
import errno
import hashlib
import importlib.util
import json
import math
import os
import re
import secrets
import shutil
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from hfexport.naming import manager_input_names, signature_names

MANIFEST = "manifest.json"
REPORT = "report.json"
MANIFEST_VERSION = 1
SINGLE = "model"  # the component name of a single (not multi-component) export
FORMATS = ("dynamo", "onnx", "executorch", "openvino")
MAIN_FILE: dict[str, str] = {
    "dynamo": "model.pt2",
    "onnx": "model.onnx",
    "executorch": "model.pte",
    "openvino": "model.xml",
}
# A manifest is small (names, config, rule report); anything much larger is not one of ours.
MAX_MANIFEST_BYTES = 32 * 1024 * 1024
MAX_DEPTH = 32
_COMPONENT_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# `os.system`, `builtins:eval`, `subprocess.Popen`: the shape of a reference to a Python object.
_IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*(?::[A-Za-z_][\w.]*)?$")
_FILE_SUFFIXES = {"onnx", "data", "pte", "pt2", "xml", "bin", "json", "safetensors", "txt", "csv", "html", "png"}
# Keys that serialisers (pickle-alikes, jsonpickle, Hydra) use to make data build objects.
_CODE_KEYS = ("_target_", "py/object", "py/reduce", "py/function", "py/type", "!!python")
Progress = Callable[[str], None]


class ArtifactError(ValueError):
    """A saved export that cannot be loaded as it is (missing, corrupt, or not what its manifest says)."""


class ManifestError(ArtifactError):
    """A manifest that is not valid JSON of the documented schema, or that names code."""


class UnsafePathError(ManifestError):
    """A manifest file path that is absolute, has `..`, or leads outside the artifact folder."""


class UntrustedArtifactError(ArtifactError):
    """A file that deserialises with pickle (a torch `.pt2`), loaded without `trust=True`."""


class ArtifactExistsError(FileExistsError):
    """The destination of a save exists and `overwrite` was not given (or it is not an artifact)."""


# -- saving ------------------------------------------------------------------------------------------------


def export_format_of(program: Any) -> str:
    """The format of a native export object, found from its type without importing any backend package."""
    cls = type(program)
    module, name = cls.__module__, cls.__name__
    import torch

    if isinstance(program, torch.export.ExportedProgram):
        return "dynamo"
    if isinstance(program, torch.onnx.ONNXProgram):
        return "onnx"
    if module.startswith("executorch.") and name == "ExecutorchProgramManager":
        return "executorch"
    openvino = sys.modules.get("openvino")
    if openvino is not None and isinstance(program, openvino.Model):
        return "openvino"
    raise TypeError(
        f"cannot save a {module}.{name}: save takes what an exporter returned (ExportedProgram, ONNXProgram, "
        "ExecutorchProgramManager, openvino.Model) or a dict of component name -> one of those"
    )


def _signature(program: Any, export_format: str) -> tuple[list[str], list[str]]:
    """(input names, output names) of a native program, as its runtime names them."""
    if export_format == "onnx":
        graph = program.model.graph
        return [str(v.name) for v in graph.inputs], [str(v.name) for v in graph.outputs]
    if export_format == "openvino":
        return [p.get_any_name() for p in program.inputs], [p.get_any_name() for p in program.outputs]
    exported = program.exported_program("forward") if export_format == "executorch" else program
    names = signature_names(exported)
    if export_format == "executorch":
        # A .pte runs on forward kwargs in the program's order: record the kwarg names, not the flat leaves.
        kwargs = manager_input_names(program)
        return kwargs or (names[0] if names else []), names[1] if names else []
    return names if names is not None else ([], [])


def _write_native(program: Any, export_format: str, folder: Path, config: Any) -> list[Path]:
    """Write one component into `folder`; return its files, the one to load first."""
    folder.mkdir(parents=True, exist_ok=True)
    main = folder / MAIN_FILE[export_format]
    if export_format == "dynamo":
        import torch

        torch.export.save(program, str(main))
    elif export_format == "onnx":
        program.save(str(main), external_data=getattr(config, "external_data", True))
    elif export_format == "executorch":
        program.save(str(main))
    else:
        import openvino

        openvino.save_model(program, str(main), compress_to_fp16=getattr(config, "compress_to_fp16", True))
    side = sorted(p for p in folder.iterdir() if p.is_file() and p.name.startswith("model.") and p != main)
    return [main, *side]


def _fsync(path: Path) -> None:
    # A rename is only as durable as the data it publishes: flush files and folders before it.
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _digest(path: Path) -> dict[str, Any]:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
    return {"size": path.stat().st_size, "sha256": sha.hexdigest()}


def _plain(value: Any) -> Any:
    """JSON-ready plain data: to_dict() of configs and reports, no objects."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if hasattr(value, "to_dict"):
        return _plain(value.to_dict())
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return str(value)


def _per_component(value: Any, names: list[str], what: str) -> dict[str, Any]:
    """A single value for every component, or a dict that must name only known components."""
    if isinstance(value, Mapping) and not hasattr(value, "to_dict"):
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise ValueError(f"{what} names unknown component(s) {unknown}; components: {names}")
        return {n: value.get(n) for n in names}
    return dict.fromkeys(names, value)


def _tmp_prefix(destination: Path) -> str:
    return f".{destination.name}.hfexport-tmp-"


def _host() -> str:
    # A folder on a shared filesystem can be written from several machines: a process id means something
    # only on the host that made it.
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _tmp_name(destination: Path, kind: str = "") -> Path:
    return destination.parent / f"{_tmp_prefix(destination)}{_host()}-{os.getpid()}-{kind}{secrets.token_hex(4)}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_dead_temporaries(destination: Path) -> None:
    """Remove temporary folders that a killed save into `destination` on this host left beside it."""
    prefix = f"{_tmp_prefix(destination)}{_host()}-"
    parent = destination.parent
    if not parent.is_dir():
        return
    for entry in parent.iterdir():
        if not entry.name.startswith(prefix):
            continue
        pid = entry.name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            shutil.rmtree(entry, ignore_errors=True)


def _is_artifact(folder: Path) -> bool:
    return (folder / MANIFEST).is_file()


def check_destination(destination: str | Path, overwrite: bool = False) -> Path:
    """Refuse a destination `save` would refuse, before any work: raises `ArtifactExistsError`.

    An absent or empty folder is fine; a non-empty one needs `overwrite=True` and must be an earlier
    artifact (it has a manifest), so that a typo never replaces an unrelated folder.
    """
    destination = Path(destination)
    if destination.is_symlink():
        raise ArtifactExistsError(f"{destination} is a symlink; save into a real folder")
    if destination.exists() and not destination.is_dir():
        raise ArtifactExistsError(f"{destination} exists and is not a folder")
    if destination.is_dir() and any(destination.iterdir()):
        if not overwrite:
            raise ArtifactExistsError(
                f"{destination} exists and is not empty; pass overwrite=True (--overwrite) to replace the "
                "artifact there"
            )
        if not _is_artifact(destination):
            raise ArtifactExistsError(
                f"{destination} is not an hfexport artifact (no {MANIFEST}); refusing to replace it even with "
                "overwrite: choose a new or empty folder"
            )
    return destination


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2); False where the libc or filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _commit(tmp: Path, destination: Path, overwrite: bool) -> None:
    check_destination(destination, overwrite)
    if destination.is_dir() and any(destination.iterdir()):
        if _exchange(tmp, destination):
            shutil.rmtree(tmp, ignore_errors=True)  # now the previous artifact
        else:
            # Two renames: a kill between them leaves no destination (and the old artifact in `old`).
            old = _tmp_name(destination, "old-")
            os.rename(destination, old)
            os.rename(tmp, destination)
            shutil.rmtree(old, ignore_errors=True)
    else:
        # rename() replaces an empty folder atomically and fails on a non-empty one that appeared meanwhile.
        os.rename(tmp, destination)
    _fsync(destination.parent)


def save(
    result: Any,
    directory: str | Path,
    *,
    overwrite: bool = False,
    config: Any = None,
    report: Any = None,
    model: str | None = None,
    validation: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    progress: Progress | None = None,
) -> Path:
    """Save an export (a native object, or a dict of component name -> native object) into `directory`.

    `config` and `report` (an `ExportReport`) are recorded in the manifest; either may be a dict per
    component. `metadata` is free plain data (no import paths). Returns the folder. Raises
    `ArtifactExistsError` when `directory` holds something and `overwrite` is false (nothing is written),
    `TypeError` for an object no exporter returns.
    """
    destination = check_destination(directory, overwrite)
    say = progress or (lambda _message: None)
    single = not isinstance(result, Mapping)
    programs: dict[str, Any] = {SINGLE: result} if single else dict(result)
    if not programs:
        raise ValueError("nothing to save: the dict of components is empty")
    for name in programs:
        if not isinstance(name, str) or not _COMPONENT_NAME.match(name) or name in (".", ".."):
            raise ValueError(f"component name {name!r} is not a plain folder name (letters, digits, _ . -)")
    formats = {name: export_format_of(p) for name, p in programs.items()}
    if len(set(formats.values())) != 1:
        raise ValueError(f"the components of one export share a format, got {formats}")
    export_format = next(iter(formats.values()))
    names = list(programs)
    configs = _per_component(config, names, "config")
    # A dict of configs (one per component) goes into each component; one config is recorded once, at the top.
    config_per_component = isinstance(config, Mapping) and not hasattr(config, "to_dict")
    reports = _per_component(report, names, "report")

    destination.parent.mkdir(parents=True, exist_ok=True)
    _remove_dead_temporaries(destination)
    tmp = _tmp_name(destination)
    tmp.mkdir()
    try:
        components: dict[str, Any] = {}
        files: list[str] = []
        for name, program in programs.items():
            say(f"saving {name}" if not single else f"saving {export_format} artifact")
            folder = tmp if single else tmp / name
            written = _write_native(program, export_format, folder, configs[name])
            comp_report = reports[name]
            if comp_report is not None and hasattr(comp_report, "save"):
                written.append(comp_report.save(folder / REPORT))
            rel = [p.relative_to(tmp).as_posix() for p in written]
            inputs, outputs = _signature(program, export_format)
            components[name] = {
                "format": export_format,
                "main": rel[0],
                "files": rel,
                "inputs": inputs,
                "outputs": outputs,
                "config": _plain(configs[name]) if config_per_component else None,
                "report": _plain(comp_report) if not single else None,
            }
            files += rel
        for path in files:
            _fsync(tmp / path)
        shared_config = None if config_per_component else config
        manifest = {
            "manifest_version": MANIFEST_VERSION,
            "format": export_format,
            "components": components,
            "files": files,
            "checksums": {path: _digest(tmp / path) for path in files},
            "model": model,
            "model_class": _first(reports, "model_class"),
            "model_type": _first(reports, "model_type"),
            "versions": _versions(reports),
            "config": _plain(shared_config),
            "report": _plain(reports[SINGLE]) if single else None,
            "validation": _plain(validation) if validation is not None else None,
            "metadata": _plain(metadata) if metadata is not None else None,
            # export_for_generation's layout (components' inputs, constants, cache leaves): how to drive them.
            "generation": _plain(spec.to_dict()) if (spec := getattr(result, "spec", None)) is not None else None,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        if single:
            # The signature at the top too, for readers of a one-model artifact.
            manifest["inputs"], manifest["outputs"] = components[SINGLE]["inputs"], components[SINGLE]["outputs"]
        check_manifest(manifest)  # what we write, we must be able to load
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        _fsync(tmp / MANIFEST)
        _fsync(tmp)
        say(f"publishing {destination}")
        _commit(tmp, destination, overwrite)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return destination


def _first(reports: Mapping[str, Any], attr: str) -> str | None:
    return next((getattr(r, attr) for r in reports.values() if getattr(r, attr, None)), None)


def _versions(reports: Mapping[str, Any]) -> dict[str, str]:
    import hfexport

    versions: dict[str, str] = {}
    for r in reports.values():
        versions.update({str(k): str(v) for k, v in (getattr(r, "versions", None) or {}).items()})
    if not versions:
        from hfexport.versions import installed_version

        for name in ("torch", "transformers"):
            found = installed_version(name)
            if found:
                versions[name] = found
    versions.setdefault("hfexport", hfexport.__version__)
    return versions


def update_manifest(directory: str | Path, **fields: Any) -> dict[str, Any]:
    """Set top-level manifest fields (`validation`, `metadata`) of a saved artifact, atomically.

    The new manifest goes through the same checks as a loaded one, then replaces the old file in one
    rename, so a reader sees the old manifest or the new one, never half of one.
    """
    directory = Path(directory)
    allowed = {"validation", "metadata"}
    if set(fields) - allowed:
        raise ValueError(f"update_manifest sets only {sorted(allowed)}, got {sorted(fields)}")
    manifest = read_manifest(directory)
    manifest.update({k: _plain(v) for k, v in fields.items()})
    check_manifest(manifest)
    tmp = directory / f".{MANIFEST}.{os.getpid()}-{secrets.token_hex(4)}"
    tmp.write_text(json.dumps(manifest, indent=2))
    _fsync(tmp)
    os.replace(tmp, directory / MANIFEST)
    _fsync(directory)
    return manifest


# -- the manifest schema -----------------------------------------------------------------------------------

_TOP_KEYS: dict[str, tuple[type, ...]] = {
    # key: allowed types (NoneType where optional)
    "manifest_version": (int,),
    "format": (str,),
    "components": (dict,),
    "files": (list,),
    "checksums": (dict,),
    "model": (str, type(None)),
    "model_class": (str, type(None)),
    "model_type": (str, type(None)),
    "versions": (dict,),
    "config": (dict, type(None)),
    "report": (dict, type(None)),
    "validation": (dict, type(None)),
    "metadata": (dict, type(None)),
    "created": (str,),
    "inputs": (list,),
    "outputs": (list,),
    "generation": (dict, type(None)),
}
_REQUIRED = ("manifest_version", "format", "components", "files", "checksums")
_COMPONENT_KEYS: dict[str, tuple[type, ...]] = {
    "format": (str,),
    "main": (str,),
    "files": (list,),
    "inputs": (list,),
    "outputs": (list,),
    "config": (dict, type(None)),
    "report": (dict, type(None)),
}
_COMPONENT_REQUIRED = ("format", "main", "files", "inputs", "outputs")


def _check_plain(value: Any, where: str, depth: int = 0) -> None:
    """Only JSON's own types, nested at most MAX_DEPTH deep, with no object-building keys."""
    if depth > MAX_DEPTH:
        raise ManifestError(f"{where} is nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ManifestError(f"{where} has a non-string key {key!r}")
            if key.startswith("__") or key in _CODE_KEYS or key.startswith("!!python"):
                raise ManifestError(f"{where} has the key {key!r}, which names code; a manifest is plain data")
            _check_plain(item, f"{where}.{key}", depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]", depth + 1)
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


def _check_no_code(value: Any, where: str) -> None:
    """Refuse strings shaped like an import path of an importable module (`os.system`, `builtins:eval`)."""
    if isinstance(value, dict):
        for key, item in value.items():
            _check_no_code(item, f"{where}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_no_code(item, f"{where}[{i}]")
    elif isinstance(value, str) and ("." in value or ":" in value) and _IMPORT_PATH.match(value):
        if value.rsplit(".", 1)[-1] in _FILE_SUFFIXES:
            return  # `model.onnx` is a file name, even where a module `model` happens to be importable
        top = re.split(r"[.:]", value, maxsplit=1)[0]
        if _importable(top):
            raise ManifestError(
                f"{where} is {value!r}, the name of Python code; a manifest holds data, and loading never "
                "imports or calls what it names"
            )


def _check_type(value: Any, types: tuple[type, ...], where: str) -> None:
    # bool is an int in Python: a `true` where a number belongs is still a schema error.
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
        raise ManifestError(f"{where} must be {names}, got {type(value).__name__}")


def _check_names(values: list[Any], where: str) -> None:
    for i, item in enumerate(values):
        if not isinstance(item, str):
            raise ManifestError(f"{where}[{i}] must be a string, got {type(item).__name__}")


def check_path(path: Any, where: str) -> str:
    """A manifest file path: relative, POSIX, no `.`/`..`/empty parts, no backslash or NUL."""
    if not isinstance(path, str) or not path:
        raise ManifestError(f"{where} must be a non-empty string path, got {path!r}")
    if "\x00" in path or "\\" in path or len(path) > 1024:
        raise UnsafePathError(f"{where} {path!r} has a NUL, a backslash, or is too long")
    pure = PurePosixPath(path)
    if pure.is_absolute() or re.match(r"^[A-Za-z]:", path):
        raise UnsafePathError(f"{where} {path!r} is absolute; manifest paths are relative to the artifact folder")
    if any(part in ("", ".", "..") for part in path.split("/")):
        raise UnsafePathError(f"{where} {path!r} has a '..', '.' or empty part; it must stay inside the folder")
    return path


def _config_fields(export_format: str) -> set[str] | None:
    import dataclasses

    from hfexport.auto import AUTO_CONFIG_MAPPING

    cls = AUTO_CONFIG_MAPPING.get(export_format)
    if cls is None or not dataclasses.is_dataclass(cls):
        return None
    return {f.name for f in dataclasses.fields(cls)} | {"export_format"}


def _check_config(config: dict[str, Any] | None, export_format: str, where: str) -> None:
    if config is None:
        return
    fields = _config_fields(export_format)
    if fields is not None:
        unknown = sorted(set(config) - fields)
        if unknown:
            raise ManifestError(f"{where} has key(s) {unknown} that are not fields of the {export_format} config")
    if config.get("export_format", export_format) != export_format:
        found = config.get("export_format")
        raise ManifestError(f"{where}.export_format is {found!r}, the artifact is {export_format}")
    # `quantizer` records which class quantized the export (its module and name, as a description for people):
    # configs never rebuild it from a dict (`from_dict` drops it), so it is plain data like the report.
    _check_no_code({k: v for k, v in config.items() if k != "quantizer"}, where)


def _dataclass_keys(cls: Any, required: bool = False) -> set[str]:
    import dataclasses

    fields = dataclasses.fields(cls)
    if required:
        return {f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    return {f.name for f in fields}


def _check_keys(data: Any, cls: Any, where: str) -> None:
    if not isinstance(data, dict):
        raise ManifestError(f"{where} must be an object")
    missing = sorted(_dataclass_keys(cls, required=True) - set(data))
    unknown = sorted(set(data) - _dataclass_keys(cls))
    if missing or unknown:
        raise ManifestError(f"{where}: missing key(s) {missing}, unknown key(s) {unknown} (a {cls.__name__})")


def _check_generation(spec: dict[str, Any] | None, components: dict[str, Any]) -> None:
    """The generation layout (`GenerationSpec.to_dict()`): exactly the keys of its dataclasses, plain values."""
    if spec is None:
        return
    from hfexport.generation_spec import CacheLeaf, ComponentSpec, GenerationSpec

    where = "manifest.generation"
    _check_keys(spec, GenerationSpec, where)
    if not isinstance(spec["components"], dict) or set(spec["components"]) - set(components):
        raise ManifestError(f"{where}.components must describe components of this artifact")
    for name, comp in spec["components"].items():
        at = f"{where}.components[{name!r}]"
        _check_keys(comp, ComponentSpec, at)
        if not isinstance(comp["inputs"], list) or not isinstance(comp["constants"], dict):
            raise ManifestError(f"{at}: inputs is a list, constants an object")
        if any(isinstance(v, (dict, list)) for v in comp["constants"].values()):
            raise ManifestError(f"{at}.constants holds scalars only")
        if not isinstance(comp["cache_leaves"], list):
            raise ManifestError(f"{at}.cache_leaves must be a list")
        for i, leaf in enumerate(comp["cache_leaves"]):
            _check_keys(leaf, CacheLeaf, f"{at}.cache_leaves[{i}]")
    _check_no_code(spec, where)


def check_manifest(manifest: Any) -> dict[str, Any]:
    """Validate a manifest (parsed JSON) against the schema; return it, or raise `ManifestError`."""
    if not isinstance(manifest, dict):
        raise ManifestError(f"a manifest is a JSON object, got {type(manifest).__name__}")
    missing = [k for k in _REQUIRED if k not in manifest]
    if missing:
        raise ManifestError(f"the manifest misses required key(s) {missing}")
    unknown = sorted(set(manifest) - set(_TOP_KEYS))
    if unknown:
        raise ManifestError(f"the manifest has unknown key(s) {unknown}; known: {sorted(_TOP_KEYS)}")
    for key, value in manifest.items():
        _check_type(value, _TOP_KEYS[key], f"manifest.{key}")
    _check_plain(manifest, "manifest")
    version = manifest["manifest_version"]
    if version != MANIFEST_VERSION:
        raise ManifestError(
            f"manifest_version {version} is not supported (this hfexport reads version {MANIFEST_VERSION})"
        )
    export_format = manifest["format"]
    if export_format not in FORMATS:
        raise ManifestError(f"manifest.format {export_format!r} is not one of {list(FORMATS)}")

    files = manifest["files"]
    for i, path in enumerate(files):
        check_path(path, f"manifest.files[{i}]")
    if len(set(files)) != len(files):
        raise ManifestError("manifest.files lists a file twice")
    checksums = manifest["checksums"]
    if set(checksums) != set(files):
        raise ManifestError("manifest.checksums must have exactly one entry per file in manifest.files")
    for path, entry in checksums.items():
        if (
            not isinstance(entry, dict)
            or set(entry) != {"size", "sha256"}
            or not isinstance(entry["size"], int)
            or isinstance(entry["size"], bool)
            or entry["size"] < 0
            or not isinstance(entry["sha256"], str)
            or not _SHA256.match(entry["sha256"])
        ):
            raise ManifestError(f"manifest.checksums[{path!r}] must be {{'size': int >= 0, 'sha256': 64 hex digits}}")

    components = manifest["components"]
    if not components:
        raise ManifestError("manifest.components is empty")
    for name, comp in components.items():
        where = f"manifest.components[{name!r}]"
        if not _COMPONENT_NAME.match(name) or name in (".", ".."):
            raise ManifestError(f"{where}: the component name is not a plain folder name")
        if not isinstance(comp, dict):
            raise ManifestError(f"{where} must be an object, got {type(comp).__name__}")
        missing = [k for k in _COMPONENT_REQUIRED if k not in comp]
        if missing:
            raise ManifestError(f"{where} misses required key(s) {missing}")
        unknown = sorted(set(comp) - set(_COMPONENT_KEYS))
        if unknown:
            raise ManifestError(f"{where} has unknown key(s) {unknown}; known: {sorted(_COMPONENT_KEYS)}")
        for key, value in comp.items():
            _check_type(value, _COMPONENT_KEYS[key], f"{where}.{key}")
        if comp["format"] != export_format:
            raise ManifestError(f"{where}.format {comp['format']!r} differs from manifest.format {export_format!r}")
        for i, path in enumerate(comp["files"]):
            check_path(path, f"{where}.files[{i}]")
            if path not in checksums:
                raise ManifestError(f"{where}.files[{i}] {path!r} is not in manifest.files")
        main = check_path(comp["main"], f"{where}.main")
        if main not in comp["files"]:
            raise ManifestError(f"{where}.main {main!r} is not one of its files")
        if PurePosixPath(main).suffix != PurePosixPath(MAIN_FILE[export_format]).suffix:
            raise ManifestError(f"{where}.main {main!r} is not a {PurePosixPath(MAIN_FILE[export_format]).suffix}")
        if export_format == "openvino" and str(PurePosixPath(main).with_suffix(".bin")) not in comp["files"]:
            raise ManifestError(f"{where}: the IR's weights {PurePosixPath(main).with_suffix('.bin')} are not listed")
        _check_names(comp["inputs"], f"{where}.inputs")
        _check_names(comp["outputs"], f"{where}.outputs")
        _check_config(comp.get("config"), export_format, f"{where}.config")
    _check_config(manifest.get("config"), export_format, "manifest.config")
    for key in ("inputs", "outputs"):
        if key in manifest:
            _check_names(manifest[key], f"manifest.{key}")
    for key in ("versions",):
        for name, value in manifest[key].items() if key in manifest else ():
            if not isinstance(value, str):
                raise ManifestError(f"manifest.{key}[{name!r}] must be a string")
    for key in ("model", "model_class", "model_type", "metadata"):
        _check_no_code(manifest.get(key), f"manifest.{key}")
    _check_generation(manifest.get("generation"), components)
    return manifest


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """Read and validate `directory/manifest.json` (schema only; files are checked by `load`)."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not directory.is_dir():
        raise ArtifactError(f"{directory} is not a folder")
    if not path.is_file():
        raise ArtifactError(f"{directory} has no {MANIFEST}: not an hfexport artifact (or an unfinished one)")
    if path.is_symlink() and not _inside(path, directory):
        raise UnsafePathError(f"{path} is a symlink out of the artifact folder")
    size = path.stat().st_size
    if size > MAX_MANIFEST_BYTES:
        raise ManifestError(f"{path} is {size} bytes; a manifest is at most {MAX_MANIFEST_BYTES}")
    try:
        manifest = json.loads(path.read_bytes().decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as exc:
        raise ManifestError(f"{path} is not valid JSON: {type(exc).__name__}: {exc}"[:500]) from None
    return check_manifest(manifest)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve(strict=False).relative_to(root.resolve())
    except ValueError:
        return False
    return True


def _check_files(directory: Path, manifest: dict[str, Any], verify: bool) -> None:
    # Every path, presence and size first (no file is read), then the hashes: a bad entry anywhere is
    # refused before any byte of any model file is read.
    for rel, expected in manifest["checksums"].items():
        path = directory / rel
        if not _inside(path, directory):
            raise UnsafePathError(f"{rel!r} leads outside {directory} (through a symlink)")
        if not path.is_file():
            raise ArtifactError(f"{directory} misses {rel!r}, which its manifest lists (an incomplete copy?)")
        size = path.stat().st_size
        if size != expected["size"]:
            raise ArtifactError(
                f"{rel!r} is {size} bytes, the manifest says {expected['size']}: a truncated or replaced file"
            )
    if verify:
        for rel, expected in manifest["checksums"].items():
            if _digest(directory / rel)["sha256"] != expected["sha256"]:
                raise ArtifactError(f"{rel!r} does not match its sha256 in the manifest: a corrupt or replaced file")


def _check_onnx_external_data(directory: Path, comp: dict[str, Any]) -> None:
    """An ONNX file names its weight files itself: they must be listed files of the same component."""
    import onnx
    from onnx.external_data_helper import _get_all_tensors

    main = directory / comp["main"]
    try:
        proto = onnx.load(str(main), load_external_data=False)
    except Exception as exc:
        raise ArtifactError(f"{comp['main']!r} is not a readable ONNX model: {type(exc).__name__}: {exc}") from None
    folder = PurePosixPath(comp["main"]).parent
    for tensor in _get_all_tensors(proto):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        location = next((e.value for e in tensor.external_data if e.key == "location"), "")
        check_path(location, f"external data of {tensor.name!r} in {comp['main']!r}")
        rel = (folder / location).as_posix() if str(folder) != "." else location
        if rel not in comp["files"]:
            raise UnsafePathError(f"{comp['main']!r} reads weights from {location!r}, which the manifest does not list")


# -- loading -----------------------------------------------------------------------------------------------


@dataclass
class LoadedComponent:
    """One component of a loaded export, opened in its runtime. `run(inputs)` -> {output name: tensor}."""

    name: str
    export_format: str
    directory: Path
    main: str
    files: list[str]
    inputs: list[str]
    outputs: list[str]
    config: dict[str, Any] | None = field(default=None, repr=False)
    report: dict[str, Any] | None = field(default=None, repr=False)
    runtime: Any = field(default=None, repr=False)

    @property
    def path(self) -> Path:
        return self.directory / self.main

    def open(self) -> Any:
        """Open the runtime once: an ExportedProgram, an ONNX Runtime session, an ExecuTorch program, or a
        compiled OpenVINO model (f32 inference hint)."""
        if self.runtime is not None:
            return self.runtime
        try:
            if self.export_format == "dynamo":
                from hfexport.runtime.dynamo import load_program

                self.runtime = load_program(self.path)
            elif self.export_format == "onnx":
                import onnxruntime

                self.runtime = onnxruntime.InferenceSession(str(self.path), providers=["CPUExecutionProvider"])
            elif self.export_format == "executorch":
                from hfexport.runtime.executorch import ExecutorchProgram

                self.runtime = ExecutorchProgram(self.path, input_names=self.inputs or None)
            else:
                from hfexport.runtime.openvino import OpenVINORunner

                self.runtime = OpenVINORunner(self.path)
        except ImportError:
            raise
        except Exception as exc:
            raise ArtifactError(
                f"component {self.name!r} ({self.main}) does not load in the {self.export_format} runtime: "
                f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
            ) from exc
        return self.runtime

    def run(self, inputs: Mapping[str, Any]) -> dict[str, Any]:
        """Run on the source model's forward kwargs; outputs by flat name (`logits`, `cache.layers_0_keys`)."""
        import torch

        from hfexport.artifacts import named_outputs, plain_name

        runtime = self.open()
        if self.export_format == "dynamo":
            with torch.no_grad():
                return named_outputs(runtime.module()(**inputs))
        if self.export_format == "onnx":
            from hfexport.naming import onnx_feed

            feed = onnx_feed([i.name for i in runtime.get_inputs()], inputs)
            names = [plain_name(o.name) for o in runtime.get_outputs()]
            return {n: torch.from_numpy(v) for n, v in zip(names, runtime.run(None, feed), strict=True)}
        if self.export_format == "executorch":
            tensors = [t for t in runtime.run(inputs) if isinstance(t, torch.Tensor)]
            names = self.outputs if len(self.outputs) == len(tensors) else [f"output_{i}" for i in range(len(tensors))]
            return {plain_name(n): t for n, t in zip(names, tensors, strict=True)}
        return {plain_name(n): t for n, t in runtime(**inputs).items()}

    def __call__(self, **inputs: Any) -> dict[str, Any]:
        return self.run(inputs)


@dataclass
class LoadedExport:
    """A loaded artifact: its components (`"model"` for a single export) and the manifest (plain data)."""

    directory: Path
    export_format: str
    components: dict[str, LoadedComponent]
    manifest: dict[str, Any] = field(repr=False)

    @property
    def config(self) -> dict[str, Any] | None:
        """The export config as recorded (plain data; `AutoExportConfig.from_dict` rebuilds it if you trust it)."""
        return self.manifest.get("config")

    @property
    def report(self) -> dict[str, Any] | None:
        return self.manifest.get("report")

    @property
    def versions(self) -> dict[str, str]:
        return dict(self.manifest.get("versions") or {})

    @property
    def generation(self) -> Any:
        """The `GenerationSpec` of an `export_for_generation` artifact (rebuilt from checked plain data), or None."""
        data = self.manifest.get("generation")
        if data is None:
            return None
        from hfexport.generation_spec import GenerationSpec

        return GenerationSpec.from_dict(data)

    def __getitem__(self, name: str) -> LoadedComponent:
        try:
            return self.components[name]
        except KeyError:
            raise KeyError(f"no component {name!r}; components: {list(self.components)}") from None

    def run(self, inputs: Mapping[str, Any], component: str | None = None) -> dict[str, Any]:
        """Run one component (the only one by default) on forward kwargs `inputs`."""
        if component is None:
            if len(self.components) != 1:
                raise ValueError(f"this export has components {list(self.components)}: name one")
            component = next(iter(self.components))
        return self[component].run(inputs)


def load(
    directory: str | Path, *, trust: bool = False, verify: bool = True, open_runtimes: bool = True
) -> LoadedExport:
    """Load an artifact written by `save` (or `hfexport export`), checking it before opening anything.

    Raises `ManifestError` (schema, code names), `UnsafePathError` (paths leaving the folder),
    `ArtifactError` (missing, truncated or corrupt files; a file its runtime cannot load) and
    `UntrustedArtifactError` (a `.pt2` without `trust=True`). `verify=False` skips the sha256 check
    (sizes are always checked); `open_runtimes=False` defers opening each runtime to its first `run`.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    export_format = manifest["format"]
    if export_format == "dynamo" and not trust:
        raise UntrustedArtifactError(
            f"{directory} holds a torch .pt2 (torch.export.save), whose parts deserialise with pickle: loading "
            "one can run code. Load it with trust=True only if you trust who wrote it"
        )
    _check_files(directory, manifest, verify)
    single = set(manifest["components"]) == {SINGLE}
    components = {}
    for name, comp in manifest["components"].items():
        if export_format == "onnx":
            _check_onnx_external_data(directory, comp)
        components[name] = LoadedComponent(
            name=name,
            export_format=export_format,
            directory=directory,
            main=comp["main"],
            files=list(comp["files"]),
            inputs=list(comp["inputs"]),
            outputs=list(comp["outputs"]),
            config=comp.get("config") if comp.get("config") is not None else manifest.get("config"),
            report=comp.get("report") if not single else manifest.get("report"),
        )
    loaded = LoadedExport(directory, export_format, components, manifest)
    if open_runtimes:
        for component in components.values():
            component.open()
    return loaded
