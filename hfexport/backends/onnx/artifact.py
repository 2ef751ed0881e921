"""How an ONNX component is saved (`ONNXProgram.save`, weights in a `.data` file) and checked before it is opened."""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Any

from hfexport.artifacts.errors import ArtifactError, UnsafePathError
from hfexport.artifacts.formats import ArtifactFormat, Signature, single_regular_file
from hfexport.artifacts.paths import check_path


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
    "onnx", _write_onnx, _onnx_signature, check_saved=_check_onnx_external_data, check_streamed=_check_streamed
)
