"""How an ONNX component is saved (`ONNXProgram.save`, weights in a `.data` file) and checked before it is opened.

The graphs of a generation artifact are saved together (`write_components`): `<component>.onnx` side by side at
the top of the artifact, every weight in one `weights.data` beside them, stored once however many graphs read it
(deduplicated by the sha256 of its bytes, dtype and shape; not by name, since two graphs may name one weight
differently or fold it differently). ONNX Runtime and `onnx.load` resolve a graph's external data inside the
graph's own folder only, so the graphs sit in the folder of the file they share.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from hfexport.artifacts.errors import ArtifactError, UnsafePathError
from hfexport.artifacts.formats import ArtifactFormat, Signature, single_regular_file
from hfexport.artifacts.paths import check_path


def _write_onnx(program: Any, main: Path, config: Any) -> None:
    program.save(str(main), external_data=getattr(config, "external_data", True))


SHARED_WEIGHTS = "weights.data"
# Tensors up to this many bytes stay inside the graph (as `ONNXProgram.save` keeps them: onnx_ir's default).
INLINE_BYTES = 256
# Tensors over 1 MiB start at a multiple of 64 KiB (onnx_ir's layout before 1.1, the allocation granularity of
# Windows): a runtime may map them from the file instead of reading them into memory of its own.
ALIGN_OVER, ALIGNMENT = 1 << 20, 1 << 16
_READ_BLOCK = 16 << 20


def _write_onnx_components(
    programs: Mapping[str, Any], folder: Path, configs: Mapping[str, Any]
) -> dict[str, list[Path]] | None:
    """Write each program as `<name>.onnx` in `folder`, all their weights once in `weights.data`; return each
    one's files (graph first). None when a config asks for weights inside the graph (`external_data=False`)."""
    import onnx_ir as ir

    if any(not getattr(config, "external_data", True) for config in configs.values()):
        return None
    folder.mkdir(parents=True, exist_ok=True)
    data_path = folder / SHARED_WEIGHTS
    stored: dict[tuple[Any, ...], tuple[int, int]] = {}
    written: dict[str, list[Path]] = {}
    with open(data_path, "w+b") as data:
        for name, program in programs.items():
            model = program.model
            values = [value for graph in model.graphs() for value in graph.initializers.values()]
            missing = [value.name for value in values if value.const_value is None]
            if missing:
                raise ValueError(f"component {name!r} has initializers without values: {missing[:10]}")
            originals = [value.const_value for value in values]
            try:
                for value, tensor in zip(values, originals, strict=True):
                    if tensor.dtype == ir.DataType.STRING or tensor.nbytes <= INLINE_BYTES:
                        continue
                    offset, length = _store(data, tensor, stored)
                    value.const_value = ir.ExternalTensor(
                        SHARED_WEIGHTS,
                        offset,
                        length,
                        tensor.dtype,
                        shape=tensor.shape,
                        name=value.name,
                        base_dir=str(folder),
                    )
                main = folder / f"{name}.onnx"
                ir.save(model, main)  # the external tensors are written as references, their bytes are in place
            finally:
                # The program is the caller's: it keeps its own tensors.
                for value, tensor in zip(values, originals, strict=True):
                    value.const_value = tensor
            written[name] = [main, data_path]
    return written


def _store(data: Any, tensor: Any, stored: dict[tuple[Any, ...], tuple[int, int]]) -> tuple[int, int]:
    """(offset, length) of `tensor`'s bytes in `data`: appended (as `tofile` writes them: a streamed weight a block
    at a time), then hashed from the file; bytes stored before are used again and the append is cut off."""
    end = data.seek(0, os.SEEK_END)
    start = -(-end // ALIGNMENT) * ALIGNMENT if tensor.nbytes > ALIGN_OVER else end
    data.write(bytes(start - end))
    tensor.tofile(data)
    data.flush()
    length = data.tell() - start
    sha = hashlib.sha256()
    fd = data.fileno()
    for at in range(start, start + length, _READ_BLOCK):
        sha.update(os.pread(fd, min(_READ_BLOCK, start + length - at), at))
    key = (str(tensor.dtype), tuple(int(d) for d in tensor.shape), length, sha.hexdigest())
    if key in stored:
        data.truncate(end)
        return stored[key]
    stored[key] = (start, length)
    return start, length


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
            sizes[rel] = single_regular_file(directory / rel, rel)
        try:
            offset, length = int(info.get("offset") or 0), int(info.get("length") or 0)
        except ValueError:
            raise ArtifactError(f"external data of {tensor.name!r}: offset/length are not integers") from None
        if offset < 0 or length < 0 or offset + length > sizes[rel]:
            raise ArtifactError(
                f"external data of {tensor.name!r} (offset {offset}, length {length}) lies past the end of "
                f"{rel!r} ({sizes[rel]} bytes)"
            )


def _check_streamed(main: Path, checkpoint: Any, quantized: bool) -> Any:
    """Every float weight against the checkpoint; with a quantizer, the quantized initializers recomputed from it."""
    from hfexport.artifacts.low_memory import StreamedWeights, check_streamed_quantized, check_streamed_weights

    weights = check_streamed_weights(main, checkpoint)
    if not quantized:
        return weights
    # The quantized initializers, recomputed from the checkpoint; the weights left in float, as above.
    computed = check_streamed_quantized(main, checkpoint)
    return StreamedWeights(
        weights.checked + computed.checked, weights.mismatched + computed.mismatched, computed.recorded
    )


ARTIFACT = ArtifactFormat(
    "onnx",
    _write_onnx,
    _onnx_signature,
    check_saved=_check_onnx_external_data,
    check_streamed=_check_streamed,
    write_components=_write_onnx_components,
)
