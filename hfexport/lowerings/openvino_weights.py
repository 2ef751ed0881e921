"""OpenVINO IR whose weights stream from a safetensors checkpoint (`OpenVINOConfig(low_memory=True)`).

OpenVINO's converter builds its `Constant`s from the program's tensors, sharing their memory, and `save_model`
writes every constant of the model. The low-memory export keeps both and never holds the weights:

1. `place_weights` (before conversion): each FakeTensor weight of the program becomes a real tensor. Small ones
   (at most `SMALL_WEIGHT` elements: norms, biases, which the converter may fold into reshaped constants) are
   read from the checkpoint. Larger ones become zero placeholders on an anonymous memory map: pages nobody
   writes hold no memory, and reading them maps the kernel's shared zero page. Each is marked (NaN first and
   last, its index in the next two elements: one page or two) so no two are equal: the conversion merges
   equal constants into one node, which would give two weights of one shape a single Const.
2. `mark_streamed` (after conversion and the `openvino` model rules): each `Constant` that shares a
   placeholder's memory is named after its weight, and the model's rt_info records which checkpoint tensor
   it holds; the marks are set back to zero. Until saved with `save_ir`, the `openvino.Model` holds
   placeholders, not weights.
3. `save_ir`: `openvino.save_model` into a temporary folder first. The placeholders are zeros, and OpenVINO's
   writer stores identical blobs once, so that `.bin` holds about one placeholder per weight shape. With
   `compress_to_fp16`, the f32 placeholders are handed over as f16 zero Consts behind decompression Converts,
   the graph OpenVINO's own compression makes, so that its writer does not convert them one by one. The final
   `.bin` is then written constant by constant in the `.xml`'s order: a streamed constant from its checkpoint
   tensor (cast to the graph's dtype, compressed to f16 as OpenVINO does), every other one copied from the
   temporary `.bin`; identical blobs once, as OpenVINO's writer does. The `.xml` gets the new offsets. A
   constant other than a streamed one that holds NaN was computed from a placeholder by the converter (a folded
   transpose, a split) and is refused: its values would be wrong.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hfexport.core.checkpoints import Checkpoint, WeightSource
from hfexport.core.errors import HfExportError

# Weights up to this many elements are read for real before conversion (as the ONNX path's optimizer reads those
# it folds): the converter folds small weights into reshaped constants (RMSNorm weights to [1, 1, hidden]).
SMALL_WEIGHT = 8192

# Model rt_info keys: {Const name: [checkpoint tensor, graph dtype]} as JSON (kept in the saved .xml, for
# `check_streamed_ir`), and the checkpoint folder (used by the save, not written into the artifact).
RECORD_KEY = "hfexport_streamed_weights"
CHECKPOINT_KEY = "hfexport_checkpoint"

# f16's range: OpenVINO's fp16 compression clamps to it (and keeps a constant in f32 when most of its values lie
# outside, a decision the streamed export cannot take: the graph is fixed before the weights are read).
_F16_MAX = 65504.0
_F16_MIN_NORMAL = 6.103515625e-05

# Rows of a weight read, converted and written at a time (with the conversion's temporaries: a few times this).
_BLOCK_BYTES = 1 << 20

_ELEMENT_TYPES: dict[str, torch.dtype] = {
    "f64": torch.float64,
    "f32": torch.float32,
    "f16": torch.float16,
    "bf16": torch.bfloat16,
    "i64": torch.int64,
    "i32": torch.int32,
    "i16": torch.int16,
    "i8": torch.int8,
    "u8": torch.uint8,
    "boolean": torch.bool,
}


@dataclass
class Placed:
    """The placeholders put into a program: {data address: (weight name, checkpoint tensor, bytes, dtype)}."""

    source: WeightSource
    by_address: dict[int, tuple[str, str, int, torch.dtype]] = field(default_factory=dict)
    tensors: list[torch.Tensor] = field(default_factory=list)


def _placeholder(shape: tuple[int, ...], dtype: torch.dtype, index: int) -> torch.Tensor:
    """Zeros of `shape` on an anonymous memory map (no memory until written), marked: NaN first and last (float
    dtypes), and `index` in the second and third elements, so that no two placeholders are equal (OpenVINO's
    conversion merges equal constants into one node)."""
    count = 1
    for size in shape:
        count *= size
    buffer = mmap.mmap(-1, count * dtype.itemsize, flags=mmap.MAP_PRIVATE)  # private: reads map the zero page
    tensor = torch.frombuffer(buffer, dtype=dtype).view(shape)  # holds a reference to the map
    flat = tensor.view(-1)
    if dtype.is_floating_point:
        flat[0] = flat[-1] = float("nan")
    # Small integers, exact in every dtype (f16 included): index = second + 1024 * third.
    flat[1], flat[2] = index % 1024 + 1, index // 1024
    return tensor


def _blank(tensor: torch.Tensor) -> None:
    flat = tensor.view(-1)
    flat[0] = flat[1] = flat[2] = flat[-1] = 0


def place_weights(program: torch.export.ExportedProgram, source: WeightSource) -> Placed:
    """Give every FakeTensor weight of `program` a real tensor for the converter (module docstring, step 1)."""
    from hfexport.frontends.empty_weights import is_empty

    placed = Placed(source)
    for store in (program.state_dict, program.constants):
        for name, value in list(store.items()):
            if not isinstance(value, torch.Tensor) or not is_empty(value):
                continue
            key = source.key_of(name, "weight")
            shape = tuple(value.shape)
            if value.numel() <= SMALL_WEIGHT:
                real = source.checkpoint.load(key, value.dtype).reshape(shape)
            else:
                real = _placeholder(shape, value.dtype, len(placed.tensors))
                placed.tensors.append(real)
                placed.by_address[real.data_ptr()] = (name, key, real.numel() * value.dtype.itemsize, value.dtype)
            is_parameter = isinstance(value, torch.nn.Parameter)
            store[name] = torch.nn.Parameter(real, requires_grad=False) if is_parameter else real
    return placed


def _constants(model: Any) -> Iterator[Any]:
    for op in model.get_ordered_ops():
        if op.get_type_name() == "Constant":
            yield op


def _address(op: Any) -> int | None:
    try:
        data = op.get_tensor_view().data
    except (RuntimeError, TypeError, ValueError):  # an element type numpy has no view of
        return None
    return int(data.__array_interface__["data"][0]) if data.size else None


def mark_streamed(model: Any, placed: Placed) -> int:
    """Name each Constant of `model` that shares a placeholder's memory after its weight and record which
    checkpoint tensor it holds in the model's rt_info (module docstring, step 2). Returns how many."""
    taken = {op.get_friendly_name() for op in model.get_ops()}
    record: dict[str, list[str]] = {}
    for op in _constants(model):
        found = placed.by_address.get(_address(op) or -1)
        if found is None:
            continue
        weight, key, nbytes, dtype = found
        if op.get_byte_size() != nbytes:
            raise HfExportError(
                f"OpenVINO made a constant of part of the weight {weight!r} ({op.get_byte_size()} of {nbytes} "
                "bytes): the low-memory export streams whole checkpoint tensors only; export without low_memory",
                stage="weights",
            )
        name, i = weight, 1
        while name in taken:
            name, i = f"{weight}/{i}", i + 1
        taken.add(name)
        op.set_friendly_name(name)
        record[name] = [key, str(dtype).removeprefix("torch.")]
    # Marks off: equal placeholders are equal blobs, which the writer stores once (a small draft .bin in
    # `save_ir`). Constants the converter computed from a placeholder keep theirs (NaN), found at the save.
    for tensor in placed.tensors:
        _blank(tensor)
    model.set_rt_info(json.dumps(record, sort_keys=True), RECORD_KEY)
    model.set_rt_info(str(placed.source.checkpoint.folder), CHECKPOINT_KEY)
    return len(record)


def _rt_info(model: Any, key: str) -> str | None:
    if not model.has_rt_info(key):
        return None
    return str(model.get_rt_info(key).astype(str))


def is_streamed(model: Any) -> bool:
    """Whether `model` (an `openvino.Model`) holds placeholders that `save_ir` fills from a checkpoint."""
    return _rt_info(model, CHECKPOINT_KEY) is not None


def save_ir(model: Any, path: str | Path, compress_to_fp16: bool = True) -> None:
    """Save `model` as IR at `path` (`.xml`, and `.bin` beside it); a low-memory export's weights are written
    from its checkpoint one tensor at a time (module docstring, step 3)."""
    import openvino as ov

    path = Path(path)
    folder = _rt_info(model, CHECKPOINT_KEY)
    if folder is None:
        ov.save_model(model, str(path), compress_to_fp16=compress_to_fp16)
        return
    record = json.loads(_rt_info(model, RECORD_KEY) or "{}")
    zero_maps: list[mmap.mmap] = []
    if compress_to_fp16:
        model = _compressed_placeholders(model, record, zero_maps)
    with tempfile.TemporaryDirectory(prefix=".hfexport-ir-", dir=path.parent) as tmp:
        draft = Path(tmp) / "model.xml"
        ov.save_model(model, str(draft), compress_to_fp16=compress_to_fp16)
        del model, zero_maps  # the clone and its f16 zero maps: the final write needs neither
        _write_streamed(draft, path, record, Checkpoint.open(folder))


def _decompression_convert() -> Any:
    """A `Convert` to f32 carrying OpenVINO's `decompression` mark, made by OpenVINO's own fp16 compression of a
    one-element model (Python cannot set that runtime attribute on a node it builds)."""
    import numpy as np
    import openvino as ov
    from openvino import opset13 as ops
    from openvino._offline_transformations import compress_model_transformation

    source = ops.parameter([1], np.float32)
    tiny = ov.Model([ops.add(source, ops.constant(np.ones(1, np.float32)))], [source])
    compress_model_transformation(tiny)
    return next(op for op in tiny.get_ordered_ops() if op.get_type_name() == "Convert")


def _compressed_placeholders(model: Any, record: dict[str, list[str]], zero_maps: list[mmap.mmap]) -> Any:
    """A clone of `model` in which every streamed f32 placeholder is already what `compress_to_fp16` makes of it:
    an f16 Const named `<weight>_compressed`, of zeros on an anonymous map, behind a `Convert` marked as
    decompression and named after the weight. The draft saved from it is the same `.xml` and `.bin` as OpenVINO's
    own compression gives, but OpenVINO's writer no longer converts each placeholder into an f16 buffer of its
    own as it writes it: that buffer (the largest weight's size in f16, 57 MB for SmolLM2-135M's embedding) was
    the low-memory save's peak. The maps are appended to `zero_maps`, which must outlive the save."""
    import numpy as np
    import openvino as ov
    from openvino import opset13 as ops

    clone = model.clone()
    for op in _constants(clone):
        name = op.get_friendly_name()
        if name not in record or op.get_element_type() != ov.Type.f32:
            continue
        shape = [int(size) for size in op.get_output_shape(0)]
        count = int(np.prod(shape, dtype=np.int64))
        zero_maps.append(mmap.mmap(-1, max(count, 1) * 2, flags=mmap.MAP_PRIVATE))
        zeros = np.frombuffer(zero_maps[-1], dtype=np.float16, count=count).reshape(shape)
        compressed = ops.constant(zeros, shared_memory=True)
        compressed.set_friendly_name(f"{name}_compressed")
        compressed.output(0).get_tensor().set_names(op.output(0).get_names())  # as OpenVINO's compression keeps them
        convert = _decompression_convert()
        convert.input(0).replace_source_output(compressed.output(0))
        convert.validate_and_infer_types()
        convert.set_friendly_name(name)
        for consumer in list(op.output(0).get_target_inputs()):
            consumer.replace_source_output(convert.output(0))
    clone.validate_nodes_and_infer_types()
    return clone


def streamed_chunks(
    name: str, key: str, dtype: torch.dtype, element_type: str, checkpoint: Checkpoint
) -> Iterator[memoryview]:
    """The bytes OpenVINO would write for checkpoint tensor `key` as an `element_type` Const of a `dtype` graph,
    in blocks of rows (`Checkpoint.load_rows`): a weight larger than memory is converted a block at a time."""
    saved = _ELEMENT_TYPES.get(element_type)
    compress = dtype == torch.float32 and saved == torch.float16
    if saved != dtype and not compress:
        raise HfExportError(
            f"the Const {name!r} is saved as {element_type}, its weight computes in {dtype}: the low-memory export "
            "writes only the checkpoint's values cast to the graph's dtype, or compressed to f16",
            stage="save",
        )
    outside, total, finite = 0, 0, True
    for block in checkpoint.load_rows(key, dtype, max_bytes=_BLOCK_BYTES):
        if compress:
            # OpenVINO clamps to f16's range and rounds to nearest even, as torch's cast does.
            magnitude = block.abs()
            outside += int(((magnitude > _F16_MAX) | ((magnitude < _F16_MIN_NORMAL) & (magnitude != 0))).sum())
            total += block.numel()
            finite = finite and bool(block.isfinite().all())
            block = block.clamp_(-_F16_MAX, _F16_MAX).half()
        yield memoryview(block.reshape(-1).view(torch.uint8).numpy())
    # OpenVINO keeps in f32 a constant most of whose values lie outside f16's range: a graph decided on the
    # real values, which the graph fixed on placeholders cannot follow. Half is far from its threshold (~3/4).
    if compress and (not finite or outside * 2 >= total):
        raise HfExportError(
            f"the weight {key!r} has {outside} of {total} values outside float16's range (or NaN/inf): "
            "OpenVINO's compress_to_fp16 may keep it in f32, which the low-memory export cannot decide before the "
            "weights are read; export with compress_to_fp16=False",
            stage="save",
        )


def _has_nan(blob: bytes, element_type: str) -> bool:
    dtype = _ELEMENT_TYPES.get(element_type)
    if dtype is None or not dtype.is_floating_point or not blob:
        return False
    return bool(torch.frombuffer(bytearray(blob), dtype=dtype).isnan().any())


def _write_streamed(draft: Path, path: Path, record: dict[str, list[str]], checkpoint: Checkpoint) -> None:
    from hfexport.lowerings.quantize_streaming import QuantizedWriter, quantized_weights

    tree = ET.parse(draft)
    root = tree.getroot()
    written: dict[bytes, list[tuple[int, int]]] = {}
    # Consts a weight-only quantizer computed from placeholders: recomputed from the checkpoint.
    quantized = QuantizedWriter(quantized_weights(root, record, checkpoint), checkpoint)
    with open(draft.with_suffix(".bin"), "rb") as old, open(path.with_suffix(".bin"), "w+b") as new:
        for layer in root.iter("layer"):
            data = layer.find("data")
            if layer.get("type") != "Const" or data is None or "offset" not in data.attrib:
                continue
            name = layer.get("name", "")
            base = name if name in record else name.removesuffix("_compressed")
            element_type, size = data.get("element_type", ""), int(data.get("size", "0"))
            chunks: Any
            if name in quantized:
                chunks = quantized.chunks(name)
            elif base in record:
                key, dtype = record[base]
                chunks = streamed_chunks(base, key, getattr(torch, dtype), element_type, checkpoint)
            else:
                old.seek(int(data.get("offset", "0")))
                blob = old.read(size)
                if _has_nan(blob, element_type):
                    raise HfExportError(
                        f"the Const {name!r} holds NaN: OpenVINO computed it from a streamed weight's placeholder "
                        "(a folded transpose or split), so its values are unknown without the weights; export "
                        "without low_memory",
                        stage="save",
                    )
                chunks = [blob]
            data.set("offset", str(_write_once(new, chunks, size, name, written)))
    rt_info = root.find("rt_info")
    if rt_info is not None:
        for item in rt_info.findall(CHECKPOINT_KEY):
            rt_info.remove(item)
    tree.write(path, encoding="utf-8", xml_declaration=True)


def share_weights(drafts: Mapping[str, Path], folder: Path, weights: str) -> dict[str, Path]:
    """Write the IRs `drafts` ({name: a saved `.xml`, its `.bin` beside it}) again as `folder/<name>.xml`, all
    reading one `folder/<weights>`: each Const's bytes are stored once, whichever IR holds them (identical blobs
    once, as `save_ir` and OpenVINO's writer store them within one IR), and each `.xml` gets their offsets there."""
    paths: dict[str, Path] = {}
    written: dict[bytes, list[tuple[int, int]]] = {}
    with open(folder / weights, "w+b") as new:
        for name, draft in drafts.items():
            tree = ET.parse(draft)
            with open(draft.with_suffix(".bin"), "rb") as old:
                for layer in tree.getroot().iter("layer"):
                    data = layer.find("data")
                    if layer.get("type") != "Const" or data is None or "offset" not in data.attrib:
                        continue
                    size = int(data.get("size", "0"))
                    old.seek(int(data.get("offset", "0")))
                    chunks = _blocks(old, size)
                    data.set("offset", str(_write_once(new, chunks, size, layer.get("name", ""), written)))
            paths[name] = folder / f"{name}.xml"
            tree.write(paths[name], encoding="utf-8", xml_declaration=True)
    return paths


def _blocks(source: Any, size: int, block: int = 64 << 20) -> Iterator[bytes]:
    """`size` bytes of `source` from its position, a block at a time."""
    while size > 0:
        chunk = source.read(min(block, size))
        if not chunk:
            raise HfExportError("an IR's .bin ends before a constant it holds", stage="save")
        size -= len(chunk)
        yield chunk


def _same_bytes(out: Any, first: int, second: int, size: int, block: int = 64 << 20) -> bool:
    for start in range(0, size, block):
        length = min(block, size - start)
        out.seek(first + start)
        a = out.read(length)
        out.seek(second + start)
        if a != out.read(length):
            return False
    return True


def _write_once(
    out: Any, chunks: Iterable[Any], size: int, name: str, written: dict[bytes, list[tuple[int, int]]]
) -> int:
    """Append the bytes of `chunks` to `out` and return their offset; when the same bytes are there already, take
    them back and return that offset instead (OpenVINO's writer also stores identical constants once)."""
    offset = out.seek(0, 2)
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk)
        out.write(chunk)
    length = out.tell() - offset
    if length != size:
        raise HfExportError(f"the Const {name!r} has {size} bytes in the IR, {length} written", stage="save")
    key = digest.digest()
    for earlier, earlier_size in written.get(key, []):
        if earlier_size == size and _same_bytes(out, earlier, offset, size):
            out.truncate(offset)
            out.seek(offset)
            return earlier
    written.setdefault(key, []).append((offset, size))
    return offset
