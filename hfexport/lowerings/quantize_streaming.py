"""Weight-only quantization of a low-memory export (OpenVINO, ONNX), computed from the checkpoint one weight at a
time. This first part is OpenVINO's; the ONNX part follows (`compress_streamed_onnx`).

NNCF's data-free weight compression (`nncf.compress_weights`, int8/int4, no dataset, no AWQ/GPTQ/scale
estimation, every weight in the chosen mode) computes each compressed weight, scale and zero point from that one
weight alone. The low-memory export runs NNCF on the model built on placeholders (zeros), which gives the graph
NNCF would build (which weights, which mode: embeddings and the head in the int8 backup mode, group size): only
their values are wrong. `save_ir` writes those constants from the checkpoint instead, each weight read, quantized
by NNCF's own `compress_weight` and turned into OpenVINO constants by NNCF's own `create_ov_const_from_tensor`,
so the bytes are the in-memory export's (tests/test_low_memory_quantize.py).

NNCF names the compressed constant after the weight's Const (which `mark_streamed` named after the weight), and
its decompression constants `<name>/scale` and `<name>/zero_point` (`OVWeightCompressionAlgoBackend.
_create_compression_subgraph`, nncf 3.4). What each was compressed with is read back from the IR: the compressed
element type gives the mode (i4: int4_sym, u4: int4_asym, i8: int8_sym, u8: int8_asym), one more dimension than
the weight gives the group size and its axis, and otherwise the scale's size-1 axis is the reduction axis.
"""

from __future__ import annotations

import functools
import json
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hfexport.core.checkpoints import Checkpoint
from hfexport.core.errors import HfExportError

# The compressed Const's element type -> the NNCF mode that writes it (OpenVINO backend, nncf 3.4).
MODES = {"i4": "int4_sym", "u4": "int4_asym", "i8": "int8_sym", "u8": "int8_asym"}
# The decompression constants NNCF adds beside the compressed weight, by suffix of the weight's Const name.
PARTS = ("", "/scale", "/zero_point")


@dataclass(frozen=True)
class QuantizedWeight:
    """A streamed weight that NNCF compressed: which checkpoint tensor, and how (read back from the IR)."""

    name: str  # the weight's Const name (the compressed Const keeps it)
    key: str  # the checkpoint tensor
    dtype: torch.dtype  # the graph's dtype the weight was compressed from
    mode: str  # an nncf.CompressWeightsMode value
    group_size: int  # -1: per channel
    axis: int  # the reduction axis of the weight
    element_type: str  # of the compressed Const
    parts: tuple[str, ...]  # the suffixes of its Consts in the IR ("", "/scale", "/zero_point")


def _shape(data: ET.Element) -> tuple[int, ...]:
    text = data.get("shape", "")
    return tuple(int(s) for s in text.split(",")) if text.strip() else ()


def quantized_weights(
    root: ET.Element, record: Mapping[str, list[str]], checkpoint: Checkpoint
) -> dict[str, tuple[QuantizedWeight, str]]:
    """{Const name: (its weight, part suffix)} for every Const of the IR `root` that NNCF computed from a streamed
    weight (recorded by `mark_streamed`) while that weight was a placeholder."""
    consts = {
        layer.get("name", ""): data
        for layer in root.iter("layer")
        if layer.get("type") == "Const" and (data := layer.find("data")) is not None
    }
    found: dict[str, tuple[QuantizedWeight, str]] = {}
    for name, (key, dtype) in record.items():
        data = consts.get(name)
        if data is None or data.get("element_type") not in MODES:
            continue
        element_type = data.get("element_type", "")
        compressed, weight = _shape(data), tuple(checkpoint.tensors[key].shape)
        scale = consts.get(f"{name}/scale")
        if scale is None:
            raise HfExportError(f"the compressed weight {name!r} has no Const {name}/scale", stage="save")
        axis, group_size = _reduction(name, weight, compressed, _shape(scale))
        parts = tuple(suffix for suffix in PARTS if f"{name}{suffix}" in consts)
        quantized = QuantizedWeight(
            name, key, getattr(torch, dtype), MODES[element_type], group_size, axis, element_type, parts
        )
        for suffix in parts:
            found[f"{name}{suffix}"] = (quantized, suffix)
    return found


def _reduction(
    name: str, weight: tuple[int, ...], compressed: tuple[int, ...], scale: tuple[int, ...]
) -> tuple[int, int]:
    """(reduction axis, group size) of a weight NNCF compressed to `compressed` with scales of shape `scale`:
    grouped quantization reshapes [a1, r, a2] to [a1, r // g, g, a2] (`reshape_weight_for_grouped_quantization`)."""
    if len(compressed) == len(weight) + 1:
        for i in range(len(weight)):
            if (
                compressed[:i] == weight[:i]
                and compressed[i + 2 :] == weight[i + 1 :]
                and compressed[i] * compressed[i + 1] == weight[i]
            ):
                return i, compressed[i + 1]
    elif compressed == weight and len(scale) == len(weight):
        axes = [i for i, (s, w) in enumerate(zip(scale, weight, strict=True)) if s == 1 and w != 1]
        if len(axes) == 1:
            return axes[0], -1
    raise HfExportError(
        f"the weight {name!r} {weight} was compressed to {compressed} with scales {scale}: not a layout the "
        "low-memory export can recompute from the checkpoint; export without low_memory",
        stage="save",
    )


def compress(quantized: QuantizedWeight, checkpoint: Checkpoint) -> dict[str, bytes]:
    """{part suffix: bytes} of the Consts NNCF writes for the checkpoint tensor of `quantized`: the tensor is read
    (only it), given to NNCF's `compress_weight` as the in-memory export gives it (an `openvino.Tensor` of the
    graph's dtype) and each result made an OpenVINO constant by NNCF's `create_ov_const_from_tensor`."""
    import openvino as ov
    from nncf.common.utils.caching import disable_results_caching
    from nncf.openvino.graph.node_utils import create_ov_const_from_tensor
    from nncf.openvino.optimized_functions.models import OV_MODEL_CACHE
    from nncf.parameters import CompressWeightsMode
    from nncf.quantization.algorithms.weight_compression.config import WeightCompressionConfig
    from nncf.quantization.algorithms.weight_compression.weight_lowering import compress_weight
    from nncf.tensor import Tensor

    if quantized.dtype not in (torch.float32, torch.float16):
        raise HfExportError(
            f"the weight {quantized.name!r} computes in {quantized.dtype}: the low-memory export quantizes float32 "
            "and float16 weights; export with dtype float32 or without low_memory",
            stage="save",
        )
    config = WeightCompressionConfig(mode=CompressWeightsMode(quantized.mode), group_size=quantized.group_size)
    weight = checkpoint.load(quantized.key, quantized.dtype)
    # As NNCF's OpenVINO backend reads a weight (`get_const_value_as_ov_tensor`): an ov.Tensor, so that the same
    # (OpenVINO-compiled) compression function runs.
    tensor = Tensor(ov.Tensor(weight.numpy()))
    with disable_results_caching(OV_MODEL_CACHE):
        result = compress_weight(tensor, (quantized.axis,), config)
    element_type = getattr(ov.Type, quantized.element_type)
    consts = {"": create_ov_const_from_tensor(result.tensor, element_type)}
    consts["/scale"] = create_ov_const_from_tensor(result.scale, ov.Type.f16)
    if result.zero_point is not None:
        consts["/zero_point"] = create_ov_const_from_tensor(result.zero_point, element_type)
    del weight, tensor, result
    return {suffix: _bytes(const) for suffix, const in consts.items()}


def _bytes(const: Any) -> bytes:
    # The Constant's own buffer as OpenVINO's writer stores it: `data` is a numpy view of it (4-bit types packed
    # two to a byte, as uint8); `bytes_data` refuses 4-bit types.
    view = const.get_tensor_view()
    blob = view.data.tobytes()
    if len(blob) != view.byte_size:
        raise HfExportError(f"a {view.element_type} constant gave {len(blob)} of {view.byte_size} bytes", stage="save")
    return blob


class QuantizedWriter:
    """The bytes of each Const NNCF computed from a streamed weight, for `_write_streamed` and the check: a weight
    is read and compressed when one of its Consts is first asked for, and its Consts are kept until another
    weight's are (the IR lists a weight's Consts one after another): one weight in memory at a time."""

    def __init__(self, consts: Mapping[str, tuple[QuantizedWeight, str]], checkpoint: Checkpoint) -> None:
        self.consts = consts
        self.checkpoint = checkpoint
        self._current: tuple[str, dict[str, bytes]] | None = None

    def __contains__(self, name: str) -> bool:
        return name in self.consts

    def chunks(self, name: str) -> Iterator[bytes]:
        quantized, suffix = self.consts[name]
        if self._current is None or self._current[0] != quantized.name:
            self._current = None  # the last weight's Consts go before the next weight is read
            self._current = (quantized.name, compress(quantized, self.checkpoint))
        blobs = self._current[1]
        if suffix not in blobs:
            raise HfExportError(
                f"the Const {name!r}: NNCF computes no {suffix or 'compressed weight'} for this weight from the "
                "checkpoint, though the IR has one",
                stage="save",
            )
        yield blobs[suffix]


# -- ONNX ----------------------------------------------------------------------------------------------------------
#
# NNCF's ONNX backend reads each weight from the model proto (`get_tensor_value`), external data included, and
# adds `<W>_quantized`, `<W>_scale` and `<W>_zero_point` initializers for a compressed weight `W`, read by a
# `MatMulNBits` (int4 at opset <= 20, which replaces the MatMul) or a `DequantizeLinear` (int8, or int4 at opset
# 21 and up) (`ONNXWeightCompressionAlgoBackend.transform_model`, nncf 3.4). The low-memory export gives NNCF the
# model with every streamed weight as external data in a sparse file of zeros (no memory, no disk), then gives
# each new initializer a lazy value computed from its weight's checkpoint tensor when the model is saved.

# Model metadata of a quantized low-memory export: {initializer: [part suffix, the streamed weight it was computed
# from, mode, group size, reduction axis, op that reads it, block size, checkpoint tensor, permutation, ONNX dtype of
# the weight]}, for `check_streamed_quantized`.
ONNX_QUANTIZED_KEY = "hfexport.streamed_quantized"
ONNX_PARTS = ("_quantized", "_scale", "_zero_point")
_SPARSE_FILE = "streamed-placeholders.bin"


@dataclass(frozen=True)
class OnnxQuantized:
    """How NNCF compressed a streamed ONNX weight, read back from the graph it built."""

    weight: str  # the streamed initializer (NNCF removed it)
    mode: str
    group_size: int  # -1: per channel
    axis: int  # the reduction axis of the weight
    op: str  # "MatMulNBits" or "DequantizeLinear"
    block_size: int  # DequantizeLinear's (0: per channel)

    def to_list(self) -> list[Any]:
        return [self.weight, self.mode, self.group_size, self.axis, self.op, self.block_size]


def _attributes(node: Any) -> dict[str, Any]:
    return {name: attr.value for name, attr in node.attributes.items()}


def _onnx_layout(model: Any, weight: str, shape: tuple[int, ...]) -> OnnxQuantized:
    import onnx_ir as ir

    quantized = model.graph.initializers[f"{weight}_quantized"]
    readers = [node for node, _ in quantized.uses()]
    node = readers[0] if len(readers) == 1 else None
    if node is not None and node.op_type == "MatMulNBits":
        attributes = _attributes(node)
        has_zero_point = len(node.inputs) > 3 and node.inputs[3] is not None
        mode = "int4_asym" if has_zero_point else "int4_sym"
        if attributes.get("bits") == 4 and (attributes.get("K"), attributes.get("N")) == shape:
            return OnnxQuantized(weight, mode, int(attributes["block_size"]), 0, "MatMulNBits", 0)
    if node is not None and node.op_type == "DequantizeLinear" and len(shape) == 2:
        attributes = _attributes(node)
        modes = {
            ir.DataType.INT4: "int4_sym",
            ir.DataType.UINT4: "int4_asym",
            ir.DataType.INT8: "int8_sym",
            ir.DataType.UINT8: "int8_asym",
        }
        mode = modes.get(quantized.const_value.dtype)
        block = int(attributes.get("block_size", 0))
        dq_axis = int(attributes.get("axis", 1)) % len(shape)
        if mode is not None:
            # Blocked: NNCF dequantizes along axis 0, the reduction axis; per channel: `axis` is the channel.
            axis = dq_axis if block else 1 - dq_axis
            return OnnxQuantized(weight, mode, block if block else -1, axis, "DequantizeLinear", block)
    raise HfExportError(
        f"NNCF compressed the streamed weight {weight!r} into a graph the low-memory export cannot recompute from "
        f"the checkpoint (read by {[n.op_type for n in readers]}); export without low_memory",
        stage="quantize",
    )


def onnx_parts(layout: OnnxQuantized, weight: Any) -> dict[str, Any]:
    """{part suffix: TensorProto} NNCF writes for `weight` (the numpy array of the streamed initializer, exactly
    as the in-memory export holds it), by NNCF's own functions in the order `transform_model` calls them."""
    import numpy as np
    import onnx
    from nncf.onnx.graph.onnx_helper import pack_4_bits, pack_int4_to_uint8
    from nncf.parameters import CompressWeightsMode
    from nncf.quantization.algorithms.weight_compression.config import WeightCompressionConfig
    from nncf.quantization.algorithms.weight_compression.onnx_backend import ONNXWeightCompressionAlgoBackend
    from nncf.quantization.algorithms.weight_compression.weight_lowering import compress_weight
    from nncf.tensor import Tensor

    mode = CompressWeightsMode(layout.mode)
    config = WeightCompressionConfig(mode=mode, group_size=layout.group_size)
    compressed = compress_weight(Tensor(weight), (layout.axis,), config)
    dtype = ONNXWeightCompressionAlgoBackend.MODE_TO_WEIGHT_DTYPE[mode]
    # `_preprocess_compressed_weight` reads no state of the backend (nncf 3.4): called unbound, it is NNCF's own
    # reshaping of the results, so the bytes cannot drift from what the in-memory path writes.
    preprocess = ONNXWeightCompressionAlgoBackend._preprocess_compressed_weight
    if layout.op == "MatMulNBits":
        tensor, scale, zero_point = preprocess(None, compressed, weight.shape, layout.axis, None, True)
        tensor = pack_int4_to_uint8(tensor, layout.group_size, signed=dtype == onnx.TensorProto.INT4)
        uint8 = onnx.TensorProto.UINT8
        parts = {"_quantized": onnx.helper.make_tensor("", uint8, tensor.shape, tensor.tobytes(), True)}
        if zero_point is not None:
            parts["_zero_point"] = onnx.helper.make_tensor(
                "", onnx.TensorProto.UINT8, zero_point.shape, zero_point.tobytes(), True
            )
    else:
        tensor, scale, zero_point = preprocess(None, compressed, weight.shape, layout.axis, layout.block_size)
        shape, zero_shape = tensor.shape, None if zero_point is None else zero_point.shape
        if dtype in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
            tensor = pack_4_bits(tensor)
            zero_point = None if zero_point is None else pack_4_bits(zero_point)
        parts = {"_quantized": onnx.helper.make_tensor("", dtype, shape, tensor.tobytes(), True)}
        if zero_point is not None:
            parts["_zero_point"] = onnx.helper.make_tensor("", dtype, zero_shape, zero_point.tobytes(), True)
    parts["_scale"] = onnx.numpy_helper.from_array(np.array(scale, dtype=np.float32))
    return parts


class _OnnxParts:
    """Lazy values of the new initializers: a weight is read and compressed when one of its parts is first asked
    for, and its parts are kept until another weight is (onnx_ir writes a weight's parts one after another)."""

    def __init__(self, layouts: Mapping[str, OnnxQuantized], weights: Mapping[str, Any]) -> None:
        self.layouts = layouts
        self.weights = weights  # {streamed initializer: its LazyTensor}
        self._current: tuple[str, dict[str, Any]] | None = None

    def tensor(self, weight: str, suffix: str) -> Any:
        import onnx_ir as ir

        if self._current is None or self._current[0] != weight:
            self._current = None  # drop the last weight's parts before reading the next weight
            self._current = (weight, onnx_parts(self.layouts[weight], self.weights[weight].numpy()))
        return ir.serde.TensorProtoTensor(self._current[1][suffix])


def _to_external(model: Any, names: Iterable[str], directory: str, values: bool) -> None:
    """Make each initializer of `model` in `names` external data in one file in `directory`: its value written
    there (`values`), or a sparse file of zeros (nothing stored: reads give zeros). The model no longer holds the
    values it had."""
    import onnx_ir as ir

    graph = model.graph
    offset = 0
    with open(Path(directory) / _SPARSE_FILE, "wb") as data:
        for name in names:
            value = graph.initializers[name]
            tensor = value.const_value
            value.const_value = ir.ExternalTensor(
                _SPARSE_FILE, offset, tensor.nbytes, tensor.dtype, shape=tensor.shape, name=name, base_dir=directory
            )
            if values:
                data.seek(offset)
                if hasattr(tensor, "tofile"):  # onnx_ir's tensors write their bytes without a copy
                    tensor.tofile(data)
                else:
                    data.write(tensor.tobytes())
            del tensor
            offset += -(-value.const_value.nbytes // 4096) * 4096
        data.truncate(offset)


def _run_on_external(model: Any, run: Callable[[Any, str], Any], directory: str) -> Any:
    """`run(proto, directory)` on `model`, whose weights are external data in `directory`, as an `onnx_ir.Model`.
    NNCF loads the external data it did not compress into the result (`compress_weights_impl`, nncf 3.4)."""
    import onnx_ir as ir

    proto = ir.to_proto(model)
    quantized = run(proto, directory)
    del proto
    return ir.from_proto(quantized)


def _external_left(model: Any) -> None:
    import onnx_ir as ir

    left = [n for n, v in model.graph.initializers.items() if isinstance(v.const_value, ir.ExternalTensor)]
    if left:
        raise HfExportError(f"NNCF left placeholder initializers {left[:3]} unfilled", stage="quantize")


def compress_streamed_onnx(model: Any, run: Callable[[Any, str], Any]) -> Any:
    """Run `run(proto, external_data_dir)` (NNCF's weight compression) on `model`, an `onnx_ir.Model` whose
    streamed weights are lazy, without reading them; return the compressed `onnx_ir.Model` whose new
    initializers are computed from the checkpoint when saved, and whose untouched streamed weights stay lazy."""
    import onnx_ir as ir

    from hfexport.lowerings.onnx import STREAMED_KEY
    from hfexport.rewrites.rules.onnx.fold_shared_weight_transpose import TRANSPOSED_FROM

    graph = model.graph
    lazies = {name: v.const_value for name, v in graph.initializers.items() if isinstance(v.const_value, ir.LazyTensor)}
    # Which checkpoint tensor (and permutation) each lazy weight holds, the tied head's transposed copy included.
    sources: dict[str, list[Any]] = json.loads(model.metadata_props.get(STREAMED_KEY, "{}"))
    for name in lazies:
        origin = graph.initializers[name].meta.get(TRANSPOSED_FROM)
        if name not in sources and origin in sources:
            key, perm = sources[origin]
            sources[name] = [key, [1, 0] if perm is None else [perm[1], perm[0]]]
    with tempfile.TemporaryDirectory(prefix="hfexport-nncf-") as tmp:
        # NNCF builds the graph it would build on the real values (which weights, mode and layout depend on shapes
        # only) on zeros; the values are computed per weight when saved.
        try:
            _to_external(model, lazies, tmp, values=False)
            quantized = _run_on_external(model, run, tmp)
        finally:
            for name, lazy in lazies.items():
                graph.initializers[name].const_value = lazy
        for name, value in quantized.graph.initializers.items():
            if name in lazies:
                value.const_value = lazies[name]
        _external_left(quantized)
    layouts: dict[str, OnnxQuantized] = {}
    for name in quantized.graph.initializers:
        weight = name.removesuffix("_quantized")
        if weight != name and weight in lazies:
            layouts[weight] = _onnx_layout(quantized, weight, tuple(lazies[weight].shape.numpy()))
    parts = _OnnxParts(layouts, lazies)
    record: dict[str, list[Any]] = {}
    for weight, layout in layouts.items():
        for suffix in ONNX_PARTS:
            value = quantized.graph.initializers.get(f"{weight}{suffix}")
            if value is None:
                continue
            old = value.const_value
            read = functools.partial(parts.tensor, weight, suffix)
            value.const_value = ir.LazyTensor(read, dtype=old.dtype, shape=old.shape, name=value.name)
            key, perm = sources.get(weight, [None, None])
            record[value.name] = [suffix, *layout.to_list(), key, perm, lazies[weight].dtype.value]
    quantized.metadata_props[STREAMED_KEY] = json.dumps(sources, sort_keys=True)
    quantized.metadata_props[ONNX_QUANTIZED_KEY] = json.dumps(record, sort_keys=True)
    return quantized


# The initializers the in-memory compression hands NNCF as external data: the float matrices, which are what it
# compresses (MatMul and Gather weights); the rest (shapes, axes, norms) stay in the proto.
_FLOATS = ("FLOAT", "FLOAT16", "BFLOAT16")


def compress_onnx_from_file(model: Any, run: Callable[[Any, str], Any]) -> Any:
    """Run `run(proto, external_data_dir)` (NNCF's data-free weight compression) on `model`, an in-memory
    `onnx_ir.Model`, with its float matrices moved to a temporary external data file: NNCF runs its whole algorithm
    on the real values (so its output is what it writes for the model in memory), reading one weight at a time,
    and neither a proto nor NNCF holds a copy of every weight. `model` is consumed: the matrices it owned (the
    optimizer's transposed weights, a tied head's copy) are freed before NNCF runs."""
    names = [
        name
        for name, value in model.graph.initializers.items()
        if value.const_value is not None
        and value.dtype is not None
        and value.dtype.name in _FLOATS
        and len(value.const_value.shape) >= 2
    ]
    with tempfile.TemporaryDirectory(prefix="hfexport-nncf-") as tmp:
        _to_external(model, names, tmp, values=True)
        quantized = _run_on_external(model, run, tmp)
        _external_left(quantized)
    return quantized
