"""What an artifact does differently per format, in one table keyed by format name.

`ARTIFACT_FORMATS[name]` says how a native object of that format is written (`write`), what its signature
is as its runtime names it (`signature`), whether its files deserialise with pickle (`pickled`: loading
needs `trust=True`), which files must sit beside the main one (`required_siblings`), and what is checked in
its files before its runtime opens them (`check_saved`). The format of an object is `hfexport.formats.format_of`;
running a saved component is the runtime's table (`hfexport.runtime.drivers`).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import stat
import xml.parsers.expat
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from hfexport.artifacts.errors import ArtifactError, UnsafePathError
from hfexport.artifacts.paths import check_path
from hfexport.artifacts.pte import check_program
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


def _check_pt2(directory: Path, comp: dict[str, Any]) -> None:
    """A `.pt2` is a zip archive: its central directory must read, and no member name may leave the archive."""
    main = comp["main"]
    try:
        with zipfile.ZipFile(directory / main) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        raise ArtifactError(f"{main!r} is not a torch.export archive (a zip): {type(exc).__name__}: {exc}") from None
    for name in names:
        if name.startswith("/") or ".." in name.split("/") or "\\" in name:
            raise UnsafePathError(f"{main!r} has a member named {name!r}, which leaves the archive")


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
    if proto.ir_version <= 0 or not proto.HasField("graph") or not proto.opset_import:
        raise ArtifactError(f"{comp['main']!r} is not an ONNX model: it has no IR version, graph or opset")
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


@functools.cache
def _pte_identifier() -> bytes:
    """The flatbuffer file identifier of an ExecuTorch program, as the installed schema declares it."""
    spec = importlib.util.find_spec("executorch")  # finds the package without running it
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        schema = Path(root) / "schema" / "program.fbs"
        if schema.is_file():
            found = re.search(r'^file_identifier\s+"(\w{4})"', schema.read_text(), re.MULTILINE)
            if found:
                return found.group(1).encode()
    return b"ET12"  # executorch/schema/program.fbs of executorch 0.4 to 1.x


def _check_pte(directory: Path, comp: dict[str, Any]) -> None:
    """The header of a `.pte`: the program identifier at bytes 4-8, and an extended header ("eh00") whose sizes
    fit the file. The ExecuTorch runtime aborts the process on some files that fail its own header check (it
    cannot decode its error text), so this is checked before the runtime sees the file."""
    main = comp["main"]
    path = directory / main
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(64)
    identifier = _pte_identifier()
    if len(head) < 8 or head[4:8] != identifier:
        raise ArtifactError(
            f"{main!r} is not an ExecuTorch program: bytes 4-8 are {head[4:8]!r}, a program has {identifier!r}"
        )
    root = int.from_bytes(head[0:4], "little")
    program_size, segment_base = size, 0
    if head[8:12] == b"eh00":
        if len(head) < 32:
            raise ArtifactError(f"{main!r} is cut short inside its extended header")
        length = int.from_bytes(head[12:16], "little")
        program_size = int.from_bytes(head[16:24], "little")
        segment_base = int.from_bytes(head[24:32], "little")
        segment_size = int.from_bytes(head[32:40], "little") if length > 24 and len(head) >= 40 else 0
        if length < 24 or not 0 < program_size <= size or (segment_base and segment_base < program_size):
            raise ArtifactError(f"{main!r} has an inconsistent extended header (a damaged or foreign file)")
        if segment_base + segment_size > size:
            raise ArtifactError(
                f"{main!r} is {size} bytes, its header says {segment_base + segment_size}: a truncated program"
            )
    if not 8 <= root < program_size:
        raise ArtifactError(f"{main!r} has its program table at {root}, outside the program ({program_size} bytes)")
    # Inside the flatbuffer: every index, type and size the runtime trusts (hfexport/artifacts/pte.py).
    check_program(path.read_bytes(), program_size, segment_base, main)


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
    from hfexport.lowerings.openvino_weights import save_ir

    save_ir(program, main, compress_to_fp16=getattr(config, "compress_to_fp16", True))


def _check_openvino_ir(directory: Path, comp: dict[str, Any]) -> None:
    """An OpenVINO IR: XML without a DTD or entities, a `<net>` root, and every constant's bytes inside the `.bin`."""
    main = comp["main"]
    weights = PurePosixPath(main).with_suffix(".bin").as_posix()
    bin_size = (directory / weights).stat().st_size
    parser = xml.parsers.expat.ParserCreate()
    seen: list[str] = []
    layer = [""]  # the type of the <layer> being read

    def refuse_dtd(*_args: Any) -> None:
        raise ArtifactError(f"{main!r} declares a DTD or entities, which an OpenVINO IR never has")

    def element(name: str, attrs: dict[str, str]) -> None:
        if not seen and name != "net":
            raise ArtifactError(f"{main!r} is not an OpenVINO IR: its root element is <{name}>, not <net>")
        seen.append(name)
        if name == "layer":
            layer[0] = attrs.get("type", "")
        elif name == "data" and layer[0] == "Const" and "offset" in attrs and "size" in attrs:
            try:
                offset, length = int(attrs["offset"]), int(attrs["size"])
            except ValueError:
                raise ArtifactError(f"{main!r}: a constant's offset/size are not integers") from None
            if offset < 0 or length < 0 or offset + length > bin_size:
                raise ArtifactError(
                    f"{main!r} reads a constant at bytes {offset}..{offset + length} of {weights!r}, which has "
                    f"{bin_size}: a truncated or mismatched weight file"
                )

    parser.StartDoctypeDeclHandler = refuse_dtd
    parser.EntityDeclHandler = refuse_dtd
    parser.StartElementHandler = element
    try:
        with open(directory / main, "rb") as f:
            parser.ParseFile(f)
    except xml.parsers.expat.ExpatError as exc:
        raise ArtifactError(f"{main!r} is not readable XML: {exc}") from None
    if not seen:
        raise ArtifactError(f"{main!r} is empty, not an OpenVINO IR")


def _openvino_signature(program: Any) -> Signature:
    return [p.get_any_name() for p in program.inputs], [p.get_any_name() for p in program.outputs]


ARTIFACT_FORMATS: dict[str, ArtifactFormat] = {
    "dynamo": ArtifactFormat("dynamo", _write_dynamo, _dynamo_signature, pickled=True, check_saved=_check_pt2),
    "onnx": ArtifactFormat("onnx", _write_onnx, _onnx_signature, check_saved=_check_onnx_external_data),
    "executorch": ArtifactFormat("executorch", _write_executorch, _executorch_signature, check_saved=_check_pte),
    "openvino": ArtifactFormat(
        "openvino",
        _write_openvino,
        _openvino_signature,
        required_siblings={".bin": "the IR's weights"},
        check_saved=_check_openvino_ir,
    ),
}
