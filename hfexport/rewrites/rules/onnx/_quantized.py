"""What the rules that rewrite a weight quantizer's output share: the lookup in a dequantized table, the checks of a
blocked int4 `DequantizeLinear`, the nibble packing of `MatMulNBits` (which `GatherBlockQuantized` reads too), and
the accuracy level a quantizer asked for."""

from __future__ import annotations

from typing import Any

# `Model.metadata_props` key: the `accuracy_level` the export's quantizer gives the `MatMulNBits` it leads to
# (`NNCFOnnxQuantizer(accuracy_level=...)`); without it the rules write 0, float activations.
ACCURACY_LEVEL_KEY = "hfexport.matmul_nbits.accuracy_level"


def int_attribute(node: Any, name: str, default: int) -> int:
    attribute = node.attributes.get(name)
    return default if attribute is None else int(attribute.as_int())


def gather_of_dequantized(op: Any, quantized: Any, indices: Any) -> Any:
    """The pattern `Gather(DequantizeLinear(quantized, ...), indices)`, its values named `table` and `rows`."""
    table = op.DequantizeLinear(quantized, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["table"])
    return op.Gather(table, indices, _allow_other_attributes=True, _outputs=["rows"])


def dequantize_inputs(dequantize: Any) -> tuple[Any, Any, int]:
    """(scale, zero point or None, block size: 0 when not blocked) of a `DequantizeLinear` node."""
    zero_point = dequantize.inputs[2] if len(dequantize.inputs) > 2 else None
    return dequantize.inputs[1], zero_point, int_attribute(dequantize, "block_size", 0)


def int4_weight_failure(quantized: Any, block: int, what: str) -> str | None:
    """Why `quantized` (a blocked `DequantizeLinear`'s input) is not a static rank-2 INT4/UINT4 `what` in blocks
    ONNX Runtime's 4-bit ops take (a power of two, at least 16), else None."""
    import onnx_ir as ir

    if quantized.dtype not in (ir.DataType.INT4, ir.DataType.UINT4):
        return f"not a rank-2 int4 / uint4 {what}"
    if quantized.shape is None or quantized.shape.rank() != 2:
        return f"not a rank-2 int4 / uint4 {what}"
    if not quantized.shape.is_static():
        return f"the {what}'s shape is not static"
    if block < 16 or block & (block - 1):
        return "not blocked in a power of two of at least 16 (the block sizes of ONNX Runtime's 4-bit ops)"
    return None


def int4_parts_failure(quantized: Any, scale: Any, zero_point: Any, blocked_shape: tuple[int, int]) -> str | None:
    """Why the int4 values, float32 scales of `blocked_shape` and uint4 zero points of the same shape (asymmetric:
    UINT4 values with zero points; symmetric: INT4 without) are not all constants in memory, else None. A low-memory
    export's streamed weights are computed when saved, in the layout NNCF chose (quantize_streaming), and stay."""
    import onnx_ir as ir

    for value, what in ((quantized, "int4 values"), (scale, "scale"), (zero_point, "zero point")):
        if value is None:
            continue
        tensor = ir.convenience.get_const_tensor(value)
        if tensor is None:
            return f"the {what} are not a constant"
        if isinstance(tensor, ir.LazyTensor):
            return f"the {what} are streamed (computed when saved)"
    if scale.dtype != ir.DataType.FLOAT:
        return "not float32 scales"
    if scale.shape is None or tuple(scale.shape) != blocked_shape:
        return f"the scales are not {list(blocked_shape)} (blocks of the int4 values)"
    if (zero_point is None) != (quantized.dtype == ir.DataType.INT4):
        return "not int4 without a zero point or uint4 with one"
    zero_shape = None if zero_point is None or zero_point.shape is None else tuple(zero_point.shape)
    if zero_point is not None and (zero_point.dtype != ir.DataType.UINT4 or zero_shape != blocked_shape):
        return "the zero points are not uint4 of the scales' shape"
    return None


def accuracy_level(model: Any) -> int:
    """The `MatMulNBits` accuracy level the export's quantizer recorded on `model` (an `onnx_ir.Model`), else 0."""
    return int(model.metadata_props.get(ACCURACY_LEVEL_KEY, 0))


def nibbles(values: Any) -> Any:
    """Pairs of 4-bit values along the last axis (even length) as bytes, the first of each pair in the low nibble."""
    import numpy as np

    values = values.astype(np.uint8)
    return (values[..., 0::2] | (values[..., 1::2] << 4)).astype(np.uint8)


def pack_matmul_nbits(quantized: Any, scale: Any, zero_point: Any, block: int) -> tuple[Any, Any, Any]:
    """(B, scales, zero_points) of `MatMulNBits` for `DequantizeLinear(quantized, scale, zero_point, axis=0,
    block_size=block)`: `quantized` int [K, N] (int4 or uint4 values), `scale` [blocks, N], `zero_point` None
    (symmetric int4) or [blocks, N] uint4 values. B is [N, blocks, block / 2]; with K a multiple of the block,
    B reshaped to [N, K / 2] is the layout `GatherBlockQuantized(bits=4, quantize_axis=1)` reads, with the same
    scales and zero points."""
    import numpy as np

    k, n = quantized.shape
    blocks = scale.shape[0]
    # Symmetric int4 in [-8, 7] is the unsigned value minus the ops' default zero point 8.
    values = quantized.astype(np.int16) + (8 if zero_point is None else 0)
    padded = np.zeros((blocks * block, n), dtype=np.int16)
    padded[:k] = values
    b = nibbles(padded.T.reshape(n, blocks, block))
    scales = np.ascontiguousarray(scale.T)
    zeros = None
    if zero_point is not None:
        rows = zero_point.T.astype(np.int16)
        if blocks % 2:
            rows = np.concatenate([rows, np.zeros((n, 1), dtype=np.int16)], axis=1)
        zeros = nibbles(rows)
    return b, scales, zeros


def initializer_maker(op: Any, graph: Any) -> Any:
    """`make(array, name)`: `array` as a new initializer of `graph` named `name`, with underscores added while that
    name is taken (by the graph or by an earlier call)."""
    import onnx_ir as ir

    taken = set(graph.initializers) if graph is not None else set()

    def make(array: Any, name: str) -> Any:
        while name in taken:
            name += "_"
        taken.add(name)
        return op.initializer(ir.tensor(array, name=name), name=name)

    return make


def int4_literal(values: Any) -> str:
    """The elements of an ONNX text tensor literal of INT4/UINT4 `values` (any shape, C order): the parser keeps each
    element as one int32 of the tensor's storage, which holds two 4-bit values (the first in the low nibble), so a
    literal of one value per element would be read as other values."""
    import numpy as np

    flat = np.asarray(values).reshape(-1).astype(np.int64) & 0xF
    if flat.size % 2:
        flat = np.concatenate([flat, [0]])
    return ", ".join(str(int(v)) for v in flat[0::2] | (flat[1::2] << 4))
