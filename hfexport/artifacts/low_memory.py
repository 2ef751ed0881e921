"""Checks of a low-memory export (ONNX, OpenVINO) that fit in memory when the model does not.

- `check_streamed_weights` (ONNX), `check_streamed_ir` (OpenVINO): every weight of the saved artifact that came
  from the checkpoint holds, byte for byte, the checkpoint tensor (cast to the export's dtype, f16-compressed
  where the IR stores it so), read one tensor at a time from both files.
- `check_reduced_depth` (`reduced_depth.py`), which `validate_low_memory` runs beside them: the same checkpoint
  cut to its first N layers, exported on the low-memory path and compared with the eager reduced model.

Neither runs the full artifact: that needs its weights in memory, which is what the caller lacks. What they
leave unchecked is listed in docs/low-memory.md.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hfexport.artifacts.errors import ArtifactError
from hfexport.artifacts.formats import artifact_format
from hfexport.artifacts.reduced_depth import ReducedDepthCheck, check_reduced_depth
from hfexport.configs import OnnxConfig, OpenVINOConfig
from hfexport.core.checkpoints import Checkpoint


@dataclass
class StreamedWeights:
    """The saved artifact's external-data weights compared with their checkpoint tensors."""

    checked: list[str]
    mismatched: list[str]
    # How many weights the artifact records as streamed, where it records them (OpenVINO). A model whose every
    # weight is small enough to be read whole (OpenVINO's placeholders start above 8192 elements) streams none,
    # and that is not a failure; where nothing is recorded (ONNX), checking nothing is one.
    recorded: int | None = None

    @property
    def ok(self) -> bool:
        if self.mismatched:
            return False
        return bool(self.checked) if self.recorded is None else len(self.checked) >= self.recorded


def check_streamed_weights(
    onnx_path: str | Path,
    checkpoint: Checkpoint,
    sources: Mapping[str, str] | None = None,
    dtypes: Mapping[str, torch.dtype] | None = None,
) -> StreamedWeights:
    """Compare each external initializer of `onnx_path` that holds a checkpoint tensor with that tensor, cast to
    the saved dtype (or `dtypes[name]`) and permuted as the export folded it, one tensor of each at a time.

    Which checkpoint tensor an initializer holds is recorded in the model's metadata by the low-memory export
    (folded transposes included); `sources` ({initializer name: tensor name}) adds or overrides entries."""
    import onnx

    from hfexport.lowerings.onnx import STREAMED_KEY

    onnx_path = Path(onnx_path)
    proto = _load_onnx(onnx_path)
    recorded = _record(proto, STREAMED_KEY, onnx_path)
    recorded.update({name: [key, None] for name, key in (sources or {}).items()})
    checked: list[str] = []
    mismatched: list[str] = []
    for tensor in proto.graph.initializer:
        if tensor.name not in recorded or tensor.data_location != onnx.TensorProto.EXTERNAL:
            continue
        entry = recorded[tensor.name]
        key, perm = entry if isinstance(entry, list) and len(entry) == 2 else (None, None)
        if not isinstance(key, str) or key not in checkpoint:
            raise ArtifactError(f"{onnx_path.name} records {tensor.name!r} as {entry!r}, no tensor of the checkpoint")
        dtype = (dtypes or {}).get(tensor.name, _TORCH_DTYPES.get(tensor.data_type))
        expected = checkpoint.load(key, dtype)
        if perm is not None:
            if not isinstance(perm, list) or sorted(perm) != list(range(expected.dim())):
                raise ArtifactError(f"{onnx_path.name} records {perm!r} for {tensor.name!r}, not a permutation")
            expected = expected.permute(tuple(perm)).contiguous()
        if _saved_bytes(onnx_path, tensor) != expected.reshape(-1).view(torch.uint8).numpy().tobytes():
            mismatched.append(tensor.name)
        checked.append(tensor.name)
    return StreamedWeights(checked, mismatched)


def _load_onnx(onnx_path: Path) -> Any:
    """The graph of `onnx_path` (no weights), its external data checked as `load` checks an artifact's: each
    location a regular file beside the model, each tensor's bytes inside it."""
    import onnx

    folder = onnx_path.parent
    beside = sorted(p.name for p in folder.iterdir() if p.is_file() and not p.is_symlink())
    # The checks `load` makes of an ONNX file before reading it (its external data inside the folder's files).
    artifact_format("onnx").check_saved(folder, {"main": onnx_path.name, "files": beside})
    return onnx.load(str(onnx_path), load_external_data=False)


def _record(proto: Any, key: str, path: Path) -> dict[str, Any]:
    """The JSON object the low-memory export recorded in the model's metadata under `key` ({} when none)."""
    text = {e.key: e.value for e in proto.metadata_props}.get(key, "{}")
    try:
        record = json.loads(text)
    except ValueError as exc:
        raise ArtifactError(f"{path.name}: its {key} metadata is not JSON ({exc})") from None
    if not isinstance(record, dict):
        raise ArtifactError(f"{path.name}: its {key} metadata is not a JSON object")
    return record


def check_streamed_ir(xml_path: str | Path, checkpoint: Checkpoint) -> StreamedWeights:
    """Compare each Const of the OpenVINO IR `xml_path` that holds a checkpoint tensor (recorded in the IR's
    rt_info by the low-memory export) with that tensor as OpenVINO stores it (cast to the graph's dtype,
    compressed to f16 where the Const is f16), one tensor of each at a time."""
    import xml.etree.ElementTree as ET

    from hfexport.lowerings.openvino_weights import RECORD_KEY, streamed_chunks
    from hfexport.lowerings.quantize_streaming import QuantizedWriter, quantized_weights

    xml_path = Path(xml_path)
    # As `load` checks an artifact's IR: no DTD or entities, every constant inside the `.bin` beside it.
    # Its weights: the `.bin` of its own, or a generation artifact's shared `weights.bin` where it has none.
    from hfexport.runtime.openvino import ir_weights

    files = [xml_path.name, ir_weights(xml_path).name]
    artifact_format("openvino").check_saved(xml_path.parent, {"main": xml_path.name, "files": files})
    root = ET.parse(xml_path).getroot()
    item = root.find(f"rt_info/{RECORD_KEY}")
    try:
        recorded = json.loads(item.get("value", "{}")) if item is not None else {}
    except ValueError as exc:
        raise ArtifactError(f"{xml_path.name}: its {RECORD_KEY} record is not JSON ({exc})") from None
    for name, entry in recorded.items() if isinstance(recorded, dict) else [("", recorded)]:
        key, dtype = entry if isinstance(entry, list) and len(entry) == 2 else (None, None)
        if not isinstance(key, str) or key not in checkpoint or dtype not in _RECORDED_DTYPES:
            raise ArtifactError(f"{xml_path.name} records {name!r} as {entry!r}, no tensor of the checkpoint")
    checked: list[str] = []
    mismatched: list[str] = []
    # Consts a weight-only quantizer computed from streamed weights: recomputed from the checkpoint.
    quantized = QuantizedWriter(quantized_weights(root, recorded, checkpoint), checkpoint)
    with open(xml_path.with_suffix(".bin"), "rb") as weights:
        for layer in root.iter("layer"):
            name, data = layer.get("name", ""), layer.find("data")
            base = name if name in recorded else name.removesuffix("_compressed")
            if layer.get("type") != "Const" or data is None or (base not in recorded and name not in quantized):
                continue
            element_type, size = data.get("element_type", ""), int(data.get("size", "0"))
            weights.seek(int(data.get("offset", "0")))
            same, read = True, 0
            if name in quantized:
                chunks: Any = quantized.chunks(name)
            else:
                key, dtype = recorded[base]
                chunks = streamed_chunks(base, key, getattr(torch, dtype), element_type, checkpoint)
            for chunk in chunks:
                same = same and weights.read(len(chunk)) == chunk
                read += len(chunk)
            if not same or read != size:
                mismatched.append(name)
            checked.append(name)
    return StreamedWeights(checked, mismatched, recorded=len(recorded))


def check_streamed_quantized(onnx_path: str | Path, checkpoint: Checkpoint) -> StreamedWeights:
    """Compare each initializer of `onnx_path` that a weight-only quantizer computed from a streamed weight
    (compressed weight, scale, zero point; recorded by the low-memory export) with the same computation (NNCF's
    `compress_weight` and its layout) redone on the weight's checkpoint tensor, one weight at a time."""
    from hfexport.lowerings.quantize_streaming import ONNX_QUANTIZED_KEY, OnnxQuantized, onnx_parts

    onnx_path = Path(onnx_path)
    proto = _load_onnx(onnx_path)
    recorded = _record(proto, ONNX_QUANTIZED_KEY, onnx_path)
    for name, entry in recorded.items():
        _check_quantized_entry(onnx_path, name, entry, checkpoint)
    by_weight: dict[str, list[Any]] = {}
    for tensor in proto.graph.initializer:
        if tensor.name in recorded:
            by_weight.setdefault(recorded[tensor.name][1], []).append(tensor)
    checked: list[str] = []
    mismatched: list[str] = []
    for tensors in by_weight.values():
        _, *layout, key, perm, data_type = recorded[tensors[0].name]
        if key is None:  # a weight whose checkpoint tensor is not recorded: nothing to compare with
            continue
        expected = checkpoint.load(key, _TORCH_DTYPES[data_type])
        if perm is not None:
            if sorted(perm) != list(range(expected.dim())):
                raise ArtifactError(f"{onnx_path.name} records {perm!r} for {key!r}, not a permutation of its axes")
            expected = expected.permute(tuple(perm)).contiguous()
        try:
            parts = onnx_parts(OnnxQuantized(*layout), expected.numpy())
        except Exception as exc:  # NNCF raises any type for a layout the record made up
            raise ArtifactError(
                f"{onnx_path.name} records a layout {layout!r} that NNCF cannot compute for {key!r} "
                f"({type(exc).__name__}: {exc})"
            ) from None
        del expected
        for tensor in tensors:
            part = parts.get(recorded[tensor.name][0])
            if part is None or _saved_bytes(onnx_path, tensor) != part.raw_data:
                mismatched.append(tensor.name)
            checked.append(tensor.name)
    return StreamedWeights(checked, mismatched, recorded=len(recorded))


# A record of `check_streamed_quantized`: [part suffix, *OnnxQuantized.to_list(), checkpoint key, perm, data type].
_QUANTIZED_ENTRY = (str, str, str, int, int, str, int, (str, type(None)), (list, type(None)), int)
_QUANTIZED_OPS = ("MatMulNBits", "DequantizeLinear")


def _check_quantized_entry(onnx_path: Path, name: str, entry: Any, checkpoint: Checkpoint) -> None:
    """Refuse a record entry of the wrong shape or types, naming a tensor the checkpoint lacks, an op the export
    never writes or a dtype it never reads: the record is data of the artifact, written by whoever wrote it."""

    def refuse(why: str) -> ArtifactError:
        return ArtifactError(f"{onnx_path.name} records {name!r} as {entry!r}: {why}")

    if not isinstance(entry, list) or len(entry) != len(_QUANTIZED_ENTRY):
        raise refuse(f"not a list of {len(_QUANTIZED_ENTRY)} fields")
    for value, kinds in zip(entry, _QUANTIZED_ENTRY, strict=True):
        if isinstance(value, bool) or not isinstance(value, kinds):
            raise refuse(f"{value!r} is not of the type the record holds there")
    _, _, mode, group_size, axis, op, block_size, key, perm, data_type = entry
    from nncf.parameters import CompressWeightsMode

    if mode not in {m.value for m in CompressWeightsMode} or op not in _QUANTIZED_OPS:
        raise refuse("an NNCF mode or an op the export does not write")
    if group_size == 0 or group_size < -1 or block_size < 0 or not -8 <= axis < 8:
        raise refuse("a group size, block size or axis out of range")
    if key is not None and key not in checkpoint:
        raise refuse("no tensor of the checkpoint")
    if perm is not None and not all(isinstance(axis, int) and not isinstance(axis, bool) for axis in perm):
        raise refuse("a permutation of other than axis numbers")
    if data_type not in _TORCH_DTYPES:
        raise refuse("an ONNX data type the checkpoint does not hold")


def _saved_bytes(onnx_path: Path, tensor: Any) -> bytes:
    import onnx

    if tensor.data_location != onnx.TensorProto.EXTERNAL:
        return bytes(tensor.raw_data)
    info = {entry.key: entry.value for entry in tensor.external_data}  # checked by `_load_onnx`
    with open(onnx_path.parent / info["location"], "rb") as data:
        data.seek(int(info.get("offset") or 0))
        return data.read(int(info.get("length") or 0))


# The dtypes an OpenVINO record names (torch attribute names, looked up only when in this set).
_RECORDED_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8"})

# ONNX TensorProto data types -> torch dtypes, for the weights a checkpoint holds.
_TORCH_DTYPES = {
    1: torch.float32,
    2: torch.uint8,
    3: torch.int8,
    6: torch.int32,
    7: torch.int64,
    9: torch.bool,
    10: torch.float16,
    11: torch.float64,
    16: torch.bfloat16,
}


@dataclass
class LowMemoryValidation:
    """`--low-memory --validate`: the saved weights against the checkpoint, and the first layers exported on the
    same path against eager (`ReducedDepthCheck`)."""

    weights: StreamedWeights
    reduced: ReducedDepthCheck
    quantized: bool

    @property
    def ok(self) -> bool:
        return self.weights.ok and self.reduced.ok

    def to_dict(self) -> dict[str, Any]:
        streamed = {"checked": len(self.weights.checked), "mismatched": self.weights.mismatched}
        return {**self.reduced.to_dict(), "ok": self.ok, "streamed_weights": streamed}

    def __str__(self) -> str:
        weights = self.weights
        if weights.recorded == 0:
            lines = ["streamed weights: none (every weight is small enough to be read whole)"]
        else:
            equal = len(weights.checked) - len(weights.mismatched)
            lines = [f"streamed weights: {equal} equal their checkpoint tensors, {len(weights.mismatched)} differ"]
            if self.quantized:
                lines.append("  (quantized weights: recomputed from the checkpoint with the quantizer's arithmetic)")
        lines.append(f"reduced depth ({self.reduced.layers} layer(s)): {self.reduced.validation}")
        return "\n".join(lines)


def validate_low_memory(
    output: str | Path,
    folder: str | Path,
    inputs: Mapping[str, Any],
    config: OnnxConfig | OpenVINOConfig,
    *,
    layers: int,
    auto_class: str,
    dtype: torch.dtype | None,
    atol: float,
    rtol: float,
    trust_remote_code: bool,
    other_inputs: Mapping[str, Mapping[str, Any]],
    progress: Callable[[str], None] = lambda _message: None,
) -> LowMemoryValidation:
    """The checks of a low-memory export that fit in memory (docs/low-memory.md): the weights saved under `output`
    compared with checkpoint `folder` tensor by tensor, and the first `layers` layers of the same checkpoint
    exported on the same path and run against eager. The full artifact is not run: that needs its weights."""
    from hfexport.formats import MAIN_FILE

    progress("validating: the saved weights against the checkpoint, one tensor at a time")
    check = artifact_format(config.export_format).check_streamed
    if check is None:
        raise ArtifactError(f"{config.export_format} cannot stream its weights: there is no low-memory export to check")
    quantized = config.quantizer is not None
    weights = check(Path(output) / MAIN_FILE[config.export_format], Checkpoint.open(folder), quantized)
    progress(f"validating: an export of the first {layers} layer(s) of the same checkpoint against eager")
    reduced = check_reduced_depth(
        folder,
        inputs,
        config,
        layers=layers,
        auto_class=auto_class,
        dtype=dtype,
        atol=atol,
        rtol=rtol,
        trust_remote_code=trust_remote_code,
        other_inputs=other_inputs,
    )
    return LowMemoryValidation(weights, reduced, quantized)
