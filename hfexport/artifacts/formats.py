"""What an artifact does differently per format, in one table keyed by format name.

`ARTIFACT_FORMATS[name]` says how a native object of that format is written (`write`), what its signature
is as its runtime names it (`signature`), whether its files deserialise with pickle (`pickled`: loading
needs `trust=True`), which files must sit beside the main one (`required_siblings`), and what is checked in
its files before its runtime opens them (`check_saved`). The format of an object is `hfexport.formats.format_of`;
running a saved component is the runtime's table (`hfexport.runtime.drivers`).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from hfexport.artifacts.errors import ArtifactError, UnsafePathError
from hfexport.artifacts.paths import check_path
from hfexport.naming import manager_input_names, signature_names

Signature = tuple[list[str], list[str]]


def _no_check(directory: Path, component: dict[str, Any]) -> None:
    return None


@dataclass(frozen=True)
class ArtifactFormat:
    name: str
    # write(program, main file path, config): write the main file and its side files beside it.
    write: Callable[[Any, Path, Any], None]
    # (input names, output names) of a native program, as its runtime names them.
    signature: Callable[[Any], Signature]
    pickled: bool = False
    # Files named like the main one, by suffix, that a component of this format must list: {suffix: what it is}.
    required_siblings: Mapping[str, str] = field(default_factory=dict)
    # Checks of a saved component's files before its runtime opens them (paths the model file itself names).
    check_saved: Callable[[Path, dict[str, Any]], None] = _no_check


# -- dynamo ------------------------------------------------------------------------------------------------


def _write_dynamo(program: Any, main: Path, config: Any) -> None:
    import torch

    torch.export.save(program, str(main))


def _dynamo_signature(program: Any) -> Signature:
    names = signature_names(program)
    return names if names is not None else ([], [])


# -- onnx --------------------------------------------------------------------------------------------------


def _write_onnx(program: Any, main: Path, config: Any) -> None:
    program.save(str(main), external_data=getattr(config, "external_data", True))


def _onnx_signature(program: Any) -> Signature:
    graph = program.model.graph
    return [str(v.name) for v in graph.inputs], [str(v.name) for v in graph.outputs]


def _onnx_tensors(message: Any) -> Any:
    """Every TensorProto anywhere in an ONNX message: initializers, sparse initializers (values and indices),
    node attributes (tensors, sparse tensors), subgraphs, functions and training info, by walking every
    message-typed field, so no place ONNX can keep a tensor is missed."""
    import onnx

    stack = [message]
    while stack:
        item = stack.pop()
        if isinstance(item, onnx.TensorProto):
            yield item
        for descriptor, value in item.ListFields():
            if descriptor.type != descriptor.TYPE_MESSAGE:
                continue
            # protobuf 6 has `is_repeated`; older ones only `label`.
            repeated = getattr(descriptor, "is_repeated", None)
            if repeated if repeated is not None else descriptor.label == descriptor.LABEL_REPEATED:
                stack.extend(value)
            else:
                stack.append(value)


def _check_onnx_external_data(directory: Path, comp: dict[str, Any]) -> None:
    """An ONNX file names its weight files itself: each must be a listed regular file of the same component
    (not a symlink, not a hard link: as `onnx.load` refuses them), and each tensor's bytes must lie inside it."""
    import onnx

    main = directory / comp["main"]
    try:
        proto = onnx.load(str(main), load_external_data=False)
    except Exception as exc:
        raise ArtifactError(f"{comp['main']!r} is not a readable ONNX model: {type(exc).__name__}: {exc}") from None
    folder = PurePosixPath(comp["main"]).parent
    sizes: dict[str, int] = {}
    for tensor in _onnx_tensors(proto):
        if tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        info = {e.key: e.value for e in tensor.external_data}
        location = info.get("location", "")
        check_path(location, f"external data of {tensor.name!r} in {comp['main']!r}")
        rel = (folder / location).as_posix() if str(folder) != "." else location
        if rel not in comp["files"]:
            raise UnsafePathError(f"{comp['main']!r} reads weights from {location!r}, which the manifest does not list")
        if rel not in sizes:
            sizes[rel] = _single_regular_file(directory / rel, rel)
        try:
            offset, length = int(info.get("offset") or 0), int(info.get("length") or 0)
        except ValueError:
            raise ArtifactError(f"external data of {tensor.name!r}: offset/length are not integers") from None
        if offset < 0 or length < 0 or offset + length > sizes[rel]:
            raise ArtifactError(
                f"external data of {tensor.name!r} (offset {offset}, length {length}) lies past the end of "
                f"{rel!r} ({sizes[rel]} bytes)"
            )


def _single_regular_file(path: Path, rel: str) -> int:
    """The size of `path`, a regular file with one name (no symlink, hard link, device or pipe)."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISREG(info.st_mode):
        raise UnsafePathError(f"{rel!r} is a symlink or a special file; weights are read from regular files only")
    if info.st_nlink != 1:
        raise UnsafePathError(f"{rel!r} is a hard link (it has {info.st_nlink} names); copy the file instead")
    return info.st_size


# -- executorch --------------------------------------------------------------------------------------------


def _write_executorch(program: Any, main: Path, config: Any) -> None:
    program.save(str(main))


def _executorch_signature(program: Any) -> Signature:
    names = signature_names(program.exported_program("forward"))
    # A .pte runs on forward kwargs in the program's order: record the kwarg names, not the flat leaves.
    kwargs = manager_input_names(program)
    return kwargs or (names[0] if names else []), names[1] if names else []


# -- openvino ----------------------------------------------------------------------------------------------


def _write_openvino(program: Any, main: Path, config: Any) -> None:
    import openvino

    if not isinstance(program, openvino.Model):
        raise TypeError(f"cannot save a {type(program).__name__}: save the openvino.Model, not a compiled one")
    openvino.save_model(program, str(main), compress_to_fp16=getattr(config, "compress_to_fp16", True))


def _openvino_signature(program: Any) -> Signature:
    return [p.get_any_name() for p in program.inputs], [p.get_any_name() for p in program.outputs]


ARTIFACT_FORMATS: dict[str, ArtifactFormat] = {
    "dynamo": ArtifactFormat("dynamo", _write_dynamo, _dynamo_signature, pickled=True),
    "onnx": ArtifactFormat("onnx", _write_onnx, _onnx_signature, check_saved=_check_onnx_external_data),
    "executorch": ArtifactFormat("executorch", _write_executorch, _executorch_signature),
    "openvino": ArtifactFormat(
        "openvino", _write_openvino, _openvino_signature, required_siblings={".bin": "the IR's weights"}
    ),
}
