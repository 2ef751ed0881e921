"""An embedding lookup in a blockwise int4 table becomes ONNX Runtime's `GatherBlockQuantized` (stage `onnx`, after
the quantizer).

NNCF's ONNX weight compression with `all_layers=True` compresses the input embedding too: from opset 21 on it
writes `Gather(DequantizeLinear(q, scale[, zero_point], axis=0, block_size=g), ids)` with `q` an INT4/UINT4
initializer [V, H] whose groups run along the hidden axis (scales [V, H / g]). Two things go wrong in ONNX Runtime:
NNCF writes `axis=0` for every blocked weight, which for this table names the wrong axis (the scales' shape says
axis 1), so the session fails on its first run ("x_scale must be ceil(Di/block_size) on the quantize axis i for
blocked quantization"); and with the right axis, ONNX Runtime would dequantize the whole table on every call (it
does not constant-fold a `DequantizeLinear`) to read one row per token.

The rule writes `GatherBlockQuantized(data, ids, scale[, zero_point], bits=4, block_size=g, gather_axis=0,
quantize_axis=1)`, which dequantizes only the gathered rows: `data` is the table's int4 values packed two a byte
in the layout of `MatMulNBits`' B (the lower index in the low nibble; symmetric INT4 stored +8, the op's default
zero point for 4-bit data), the scales are the table's own, the zero points packed two blocks a byte. Row `i` is
`(q[i] - zero_point[i, block]) * scale[i, block]` per element, as `DequantizeLinear` defines it, so the values are
the same. The blocked axis is read from the scales' shape (blocks along the rows stay as they are: the op
dequantizes blocks of a row). A tied output projection holds the same table, transposed: `onnx/tied-int4-table-once`
lets both read one copy.
"""

from __future__ import annotations

from typing import Any

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.onnx import OnnxRewriteRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.onnx._quantized import (
    dequantize_inputs,
    gather_of_dequantized,
    initializer_maker,
    int4_literal,
    int4_parts_failure,
    int4_weight_failure,
    int_attribute,
    pack_matmul_nbits,
)


def _rule() -> Any:
    import numpy as np
    import onnx_ir as ir
    from onnxscript.rewriter import pattern

    def constant(value: Any) -> Any:
        return ir.convenience.get_const_tensor(value)

    class BlockedDequantizeGather(pattern.RewriteRuleClassBase):
        def pattern(self, op: Any, quantized: Any, indices: Any) -> Any:
            return gather_of_dequantized(op, quantized, indices)

        def check(self, context: Any, quantized: Any, indices: Any, table: Any, rows: Any, **_: Any) -> Any:
            result = pattern.MatchResult()
            dequantize, gather = table.producer(), rows.producer()
            if int_attribute(gather, "axis", 0) != 0:
                return result.fail("a Gather along another axis than the rows", gather)
            scale, zero_point, block = dequantize_inputs(dequantize)
            failure = int4_weight_failure(quantized, block, "table")
            if failure:
                return result.fail(failure, quantized)
            rows_, width = quantized.shape
            if int_attribute(dequantize, "axis", 1) not in (0, 1, -1, -2):
                return result.fail("a DequantizeLinear axis other than 0 or 1", table)
            # The blocked axis as the scales' shape says it (NNCF writes axis 0 for a table blocked along axis 1); a
            # table blocked along its rows ([ceil(V / g), H] scales) is valid, but the op cannot dequantize it.
            failure = int4_parts_failure(quantized, scale, zero_point, (rows_, -(-width // block)))
            if failure:
                return result.fail(failure, table)
            if width % block:
                return result.fail("a row's width is not a multiple of the block", quantized)
            return result

        def rewrite(self, op: Any, quantized: Any, indices: Any, table: Any, **_: Any) -> Any:
            scale, zero_point, block = dequantize_inputs(table.producer())
            rows_, _ = quantized.shape
            # MatMulNBits' packing of the transposed table: B [V, blocks, g / 2] is [V, H / 2] row by row.
            data, _, zeros = pack_matmul_nbits(
                constant(quantized).numpy().astype(np.int16).T,
                constant(scale).numpy().T,
                None if zero_point is None else constant(zero_point).numpy().astype(np.int16).T,
                block,
            )
            initializer = initializer_maker(op, quantized.graph)
            inputs = [initializer(data.reshape(rows_, -1), f"{quantized.name}.gather"), indices, scale]
            if zeros is not None:
                inputs.append(initializer(zeros, f"{zero_point.name}.gather"))
            return op.GatherBlockQuantized(
                *inputs, bits=4, block_size=block, gather_axis=0, quantize_axis=1, _domain="com.microsoft"
            )

    return BlockedDequantizeGather.rule()


# -- examples: ONNX text models of the table NNCF writes (int4 values as Constant nodes), with the valid axis -------


def table_model(rows: int, width: int, block: int, signed: bool, along_rows: bool = False) -> str:
    """`Gather(DequantizeLinear(q, scale[, zero], block_size=block), ids)` of a [rows, width] int4 table blocked
    along its rows' width (`along_rows`: blocked along the rows instead)."""
    import numpy as np

    rng = np.random.default_rng(0)
    values = rng.integers(-8, 8, size=(rows, width)) if signed else rng.integers(0, 16, size=(rows, width))
    scale_shape = (-(-rows // block), width) if along_rows else (rows, -(-width // block))
    scales = np.round(rng.uniform(0.01, 0.5, size=scale_shape), 4)
    kind = "int4" if signed else "uint4"
    constants = {
        "q": f"{kind}[{rows},{width}] {{{int4_literal(values)}}}",
        "scale": f"float[{scale_shape[0]},{scale_shape[1]}] {{{', '.join(str(v) for v in scales.flat)}}}",
    }
    inputs = "q, scale"
    if not signed:
        zeros = rng.integers(0, 16, size=scale_shape)
        constants["zero"] = f"uint4[{scale_shape[0]},{scale_shape[1]}] {{{int4_literal(zeros)}}}"
        inputs += ", zero"
    declared = ", ".join(f"{value.split(' {')[0]} {name}" for name, value in constants.items())
    nodes = "\n".join(f"  {name} = Constant <value = {value}> ()" for name, value in constants.items())
    return f"""
<ir_version: 10, opset_import: ["" : 21, "com.microsoft" : 1]>
g (int64[2,3] ids) => (float[2,3,{width}] y) <{declared}, float[{rows},{width}] table> {{
{nodes}
  table = DequantizeLinear <axis = {0 if along_rows else 1}, block_size = {block}> ({inputs})
  y = Gather <axis = 0> (table, ids)
}}
"""


def table_ids(rows: int) -> dict[str, Any]:
    import numpy as np

    # A repeated row, the first and the last, and a negative index (Gather counts from the end).
    return {"ids": np.array([[0, rows - 1, 2], [2, -1, 3]], dtype=np.int64)}


blocked_dequantize_gather = OnnxRewriteRule(
    meta=RuleMeta(
        id="onnx/blocked-dequantize-gather",
        why="NNCFOnnxQuantizer's int4 recipe with the embedding in int4 (all_layers, as onnxruntime-genai and "
        "optimum-intel quantize it) failed in ONNX Runtime ('x_scale must be ceil(Di/block_size) on the quantize "
        "axis': NNCF writes axis 0 for the table blocked along axis 1), and with the axis right ONNX Runtime would "
        "rebuild the whole float table (49152 x 576 at the SmolLM2 shape: 113 MB) each call to read one row; "
        "GatherBlockQuantized dequantizes only the gathered rows, the same values, and keeps the table at 4 bits, "
        "so the float embedding (113 MB a graph at the SmolLM2 shape) leaves the artifact",
        upstream="nncf==3.4.0 nncf/quantization/algorithms/weight_compression/onnx_backend.py transform_model "
        "(dequantize_axis = 0 when blockwise, whatever the reduction axis); onnxruntime==1.32.0 contrib op "
        "com.microsoft.GatherBlockQuantized",
        backends=("onnx",),
        models=("llama", "qwen2", "qwen3", "nncf-onnx"),
        kind="optimization",
        examples=(
            Match(
                lambda: (table_model(6, 64, 32, signed=True), table_ids(6)),
                "int4 table [6, 64] in groups of 32 (symmetric); repeated, first, last and negative ids",
            ),
            Match(
                lambda: (table_model(5, 96, 32, signed=False), table_ids(5)),
                "uint4 table [5, 96] with zero points (3 blocks a row: an odd count of zero points)",
            ),
            NoMatch(
                lambda: (table_model(64, 8, 32, signed=True, along_rows=True), table_ids(64)),
                "blocks along the rows (scales [2, 8])",
                reason="the scales are not [64, 1] (blocks of the int4 values): blocks along the rows",
            ),
        ),
    ),
    rewrite_rule=_rule,
    phase="quantized",
)
