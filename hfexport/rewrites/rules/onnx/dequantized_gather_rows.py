"""An embedding lookup in a per-row quantized table dequantizes only the rows it reads (stage `onnx`, after the
quantizer).

NNCF's weight compression keeps the input embedding in int8 with one scale (and zero point) per row and writes
`Gather(DequantizeLinear(table, scale, zero_point, axis=0), input_ids)`. ONNX Runtime does not fold a
`DequantizeLinear` of an initializer (it keeps QDQ pairs for its own fusions), so every call rebuilt the whole
float table to read a few rows of it: for SmolLM2-135M's 49152 x 576 vocabulary 113 MB written and read per
decode step, the largest single cost of its NNCF int4 decode (profile: 18 of 67 ms a step on 2 layers).

Gathering first reads the same values: row `i` of the dequantized table is `(table[i] - zero_point[i]) *
scale[i]`, which is what the rewrite computes from the gathered rows, in the operations ONNX's
`DequantizeLinear` is defined by (the integer difference, converted to float, times the scale), so the result is
identical, element for element.
"""

from __future__ import annotations

from typing import Any

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.onnx import OnnxRewriteRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.onnx._quantized import gather_of_dequantized, int_attribute


def _rule() -> Any:
    import onnx_ir as ir
    from onnxscript.rewriter import pattern

    integer_tables = (ir.DataType.UINT8, ir.DataType.INT8)

    class DequantizedGatherRows(pattern.RewriteRuleClassBase):
        """`Gather(DequantizeLinear(q, s[, zp], axis=0), indices, axis=0)` on a rank-2 table with one scale per row."""

        def pattern(self, op: Any, quantized: Any, indices: Any) -> Any:
            return gather_of_dequantized(op, quantized, indices)

        def check(self, context: Any, quantized: Any, indices: Any, table: Any, rows: Any, **_: Any) -> Any:
            result = pattern.MatchResult()
            dequantize, gather = table.producer(), rows.producer()
            if int_attribute(gather, "axis", 0) != 0:
                return result.fail("a Gather along another axis than the rows", gather)
            if quantized.dtype not in integer_tables or quantized.shape is None or quantized.shape.rank() != 2:
                return result.fail("not a rank-2 int8 / uint8 table", quantized)
            if int_attribute(dequantize, "block_size", 0) != 0:
                return result.fail("a blocked DequantizeLinear (several scales per row)", dequantize)
            if int_attribute(dequantize, "axis", 1) not in (0, -2):
                return result.fail("scales along the columns, not one per row", dequantize)
            scale = dequantize.inputs[1]
            if scale is None or scale.dtype != ir.DataType.FLOAT or scale.shape is None or scale.shape.rank() != 1:
                return result.fail("not one float32 scale per row", scale)
            zero_point = dequantize.inputs[2] if len(dequantize.inputs) > 2 else None
            if zero_point is not None and (zero_point.shape is None or zero_point.shape.rank() != 1):
                return result.fail("not one zero point per row", zero_point)
            return result

        def rewrite(self, op: Any, quantized: Any, indices: Any, table: Any, **_: Any) -> Any:
            dequantize = table.producer()
            scale = dequantize.inputs[1]
            zero_point = dequantize.inputs[2] if len(dequantize.inputs) > 2 else None
            last = op.Constant(value_ints=[-1])
            # int32 holds every difference of two 8-bit values; converted to float exactly (|x| < 2**24).
            values = op.Cast(op.Gather(quantized, indices, axis=0), to=ir.DataType.INT32)
            if zero_point is not None:
                offsets = op.Cast(op.Gather(zero_point, indices, axis=0), to=ir.DataType.INT32)
                values = op.Sub(values, op.Unsqueeze(offsets, last))
            scales = op.Unsqueeze(op.Gather(scale, indices, axis=0), last)
            return op.Mul(op.Cast(values, to=ir.DataType.FLOAT), scales)

    return DequantizedGatherRows.rule()


# -- examples: ONNX text models as NNCF writes them, with the tables as Constant nodes and every value typed (the
# serializer adds value infos of initializers and the rewriter types untyped values, which would read as a change) --

_ROWS = ", ".join(str((7 * i + 3) % 256) for i in range(24))


def _model(dequantize: str, constants: dict[str, str]) -> str:
    declared = ", ".join(f"{value.split(' {')[0]} {name}" for name, value in constants.items())
    nodes = "\n".join(f"  {name} = Constant <value = {value}> ()" for name, value in constants.items())
    return f"""
<ir_version: 10, opset_import: ["" : 20]>
g (int64[2,3] ids) => (float[2,3,4] y) <{declared}, float[6,4] dense> {{
{nodes}
  dense = {dequantize}
  y = Gather <axis = 0> (dense, ids)
}}
"""


def _ids() -> dict[str, Any]:
    import numpy as np

    # A repeated row, the first and the last, and a negative index (Gather counts from the end).
    return {"ids": np.array([[0, 5, 2], [2, -1, 3]], dtype=np.int64)}


def _uint8_table(scale: str, zero: str) -> dict[str, str]:
    return {"table": f"uint8[6,4] {{{_ROWS}}}", "scale": scale, "zero": zero}


def _asymmetric() -> Any:
    constants = _uint8_table("float[6] {0.5, 0.25, 2.0, 0.125, 1.5, 3.0}", "uint8[6] {128, 3, 0, 255, 17, 9}")
    return _model("DequantizeLinear <axis = 0> (table, scale, zero)", constants), _ids()


def _symmetric() -> Any:
    signed = ", ".join(str((7 * i + 3) % 256 - 128) for i in range(24))
    constants = {"table": f"int8[6,4] {{{signed}}}", "scale": "float[6] {0.5, 0.25, 2.0, 0.125, 1.5, 3.0}"}
    return _model("DequantizeLinear <axis = 0> (table, scale)", constants), _ids()


def _per_column() -> Any:
    constants = _uint8_table("float[4] {0.5, 0.25, 2.0, 0.125}", "uint8[4] {1, 2, 3, 4}")
    return _model("DequantizeLinear <axis = 1> (table, scale, zero)", constants), _ids()


dequantized_gather_rows = OnnxRewriteRule(
    meta=RuleMeta(
        id="onnx/dequantized-gather-rows",
        why="NNCFOnnxQuantizer's int4 export of SmolLM2-135M (tied embeddings) keeps the embedding table in int8 "
        "per row, and ONNX Runtime dequantized the whole 49152 x 576 table on every call to gather one row per "
        "token (ORT profile of a 2-layer decode: DequantizeLinear 18 ms of 67 ms a step). Gathering the int8 rows "
        "and their scales first computes the same values: identical outputs, one row dequantized per token",
        upstream="onnxruntime==1.32.0 onnxruntime/core/optimizer/constant_folding.cc (DequantizeLinear is "
        "excluded from constant folding, to keep QDQ groups for the QDQ transformers)",
        backends=("onnx",),
        models=("llama", "nncf-onnx"),
        kind="optimization",
        examples=(
            Match(_asymmetric, "uint8 table with a zero point per row; repeated, first, last and negative ids"),
            Match(_symmetric, "int8 table, symmetric (no zero point)"),
            NoMatch(
                _per_column,
                "scales per column (axis 1): a gathered row needs every scale",
                reason="scales along the columns, not one per row",
            ),
        ),
    ),
    rewrite_rule=_rule,
    phase="quantized",
)
