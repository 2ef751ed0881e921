"""A tied embedding and output projection quantized to the same int4 blocks read one copy of them (stage `onnx`,
after the quantizer).

With tied embeddings (SmolLM2, Llama-3.2, small Qwen: `lm_head.weight` is `embed_tokens.weight`) NNCF compresses
the table twice: the embedding's `Gather` reads it as it is, the head's `MatMul` reads the transposed copy
`onnx/fold-shared-weight-transpose` gives it (NNCF cannot find a weight behind a runtime `Transpose`). Both are the
same [V, H] matrix in the same groups of the hidden axis, so NNCF computes the same int4 values and scales, and
once `onnx/blocked-dequantize-gather` and `onnx/blocked-dequantize-matmul-nbits` have written them they are the
same bytes: `GatherBlockQuantized`'s data [V, H / 2] is the head's `MatMulNBits` B [V, blocks, g / 2] row by row,
and its scales and zero points are the head's.

The rule lets the `GatherBlockQuantized` read the head's initializers (B through a `Reshape` to [V, H / 2], which
ONNX Runtime folds when the session starts), where they hold equal bytes; its own copies are then unused and
leave the model. The values read are the same, so the outputs are identical. This is what onnxruntime-genai's
builder writes for a tied int4 model (one table, read by both ops).
"""

from __future__ import annotations

from typing import Any

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.onnx import OnnxRewriteRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.onnx._quantized import int4_literal, int_attribute


def _array(value: Any) -> Any:
    """The numpy value of an initializer that is not streamed (a low-memory export's are computed when saved)."""
    import onnx_ir as ir

    if value is None:
        return None
    tensor = ir.convenience.get_const_tensor(value)
    return None if tensor is None or isinstance(tensor, ir.LazyTensor) else tensor.numpy()


def _same(a: Any, b: Any) -> bool:
    import numpy as np

    return a is not None and b is not None and a.size == b.size and np.array_equal(a.reshape(-1), b.reshape(-1))


def _head_reading(gather: Any, data: Any, scales: Any, zeros: Any) -> Any:
    """The `MatMulNBits` of the graph whose B, scales and zero points are the gather's data, scales and zero points
    (as bytes), else None."""
    rows, width = data.shape
    for node in gather.graph.all_nodes() if gather.graph is not None else ():
        if node.op_type != "MatMulNBits" or node.domain != "com.microsoft":
            continue
        if (
            int_attribute(node, "N", 0) != rows
            or int_attribute(node, "K", 0) != 2 * width
            or int_attribute(node, "bits", 4) != 4
            or int_attribute(node, "block_size", 0) != int_attribute(gather, "block_size", 0)
        ):
            continue
        inputs = list(node.inputs) + [None] * 4
        head_zeros = inputs[3]
        if (zeros is None) != (head_zeros is None or _array(head_zeros) is None):
            continue
        if not _same(_array(inputs[1]), data) or not _same(_array(inputs[2]), scales):
            continue
        if zeros is not None and not _same(_array(head_zeros), zeros):
            continue
        return node
    return None


def _rule() -> Any:
    from onnxscript.rewriter import pattern

    class TiedInt4TableOnce(pattern.RewriteRuleClassBase):
        head: Any = None

        def pattern(self, op: Any, data: Any, indices: Any, scales: Any) -> Any:
            return op.GatherBlockQuantized(
                data,
                indices,
                scales,
                _domain="com.microsoft",
                _allow_other_inputs=True,
                _allow_other_attributes=True,
                _outputs=["rows"],
            )

        def check(self, context: Any, data: Any, indices: Any, scales: Any, rows: Any, **_: Any) -> Any:
            result = pattern.MatchResult()
            gather = rows.producer()
            if int_attribute(gather, "bits", 4) != 4 or int_attribute(gather, "gather_axis", 0) != 0:
                return result.fail("not a 4-bit table gathered along its rows", gather)
            table = _array(data)
            if table is None or table.ndim != 2 or int_attribute(gather, "quantize_axis", 1) not in (1, -1):
                return result.fail("not a constant [rows, width / 2] table blocked along its rows", data)
            zeros = gather.inputs[3] if len(gather.inputs) > 3 else None
            head = _head_reading(gather, table, _array(scales), _array(zeros))
            if head is None:
                return result.fail("no MatMulNBits holds the same 4-bit blocks, scales and zero points", data)
            self.head = head
            return result

        def rewrite(self, op: Any, data: Any, indices: Any, scales: Any, rows: Any, **_: Any) -> Any:
            gather = rows.producer()
            head_inputs = list(self.head.inputs) + [None] * 4
            shape = op.Constant(value_ints=list(data.shape))
            inputs = [op.Reshape(head_inputs[1], shape), indices, head_inputs[2]]
            if len(gather.inputs) > 3 and gather.inputs[3] is not None:
                inputs.append(head_inputs[3])
            attributes = {name: attribute.as_int() for name, attribute in gather.attributes.items()}
            return op.GatherBlockQuantized(*inputs, **attributes, _domain="com.microsoft")

    return TiedInt4TableOnce.rule()


# -- examples: a tied table as NNCF leaves it (the Gather's [V, H] and the head's transposed copy [H, V], the same
# int4 values and scales), which the two rules it requires turn into GatherBlockQuantized and MatMulNBits ----------


def _tied(rows: int, width: int, block: int, signed: bool) -> str:
    import numpy as np

    rng = np.random.default_rng(0)
    values = rng.integers(-8, 8, size=(rows, width)) if signed else rng.integers(0, 16, size=(rows, width))
    blocks = width // block
    scales = np.round(rng.uniform(0.01, 0.5, size=(rows, blocks)), 4)
    zeros = rng.integers(0, 16, size=(rows, blocks))
    kind = "int4" if signed else "uint4"

    def flat(array: Any) -> str:
        return ", ".join(str(v) for v in array.flat)

    constants = {
        "q": f"{kind}[{rows},{width}] {{{int4_literal(values)}}}",
        "s": f"float[{rows},{blocks}] {{{flat(scales)}}}",
        "qt": f"{kind}[{width},{rows}] {{{int4_literal(values.T)}}}",
        "st": f"float[{blocks},{rows}] {{{flat(scales.T)}}}",
    }
    table_inputs, head_inputs = "q, s", "qt, st"
    if not signed:
        constants["z"] = f"uint4[{rows},{blocks}] {{{int4_literal(zeros)}}}"
        constants["zt"] = f"uint4[{blocks},{rows}] {{{int4_literal(zeros.T)}}}"
        table_inputs, head_inputs = "q, s, z", "qt, st, zt"
    declared = ", ".join(f"{value.split(' {')[0]} {name}" for name, value in constants.items())
    nodes = "\n".join(f"  {name} = Constant <value = {value}> ()" for name, value in constants.items())
    return f"""
<ir_version: 10, opset_import: ["" : 21, "com.microsoft" : 1]>
g (int64[2,3] ids) => (float[2,3,{rows}] logits) <{declared}, float[{rows},{width}] table, float[2,3,{width}] h,
    float[{width},{rows}] head> {{
{nodes}
  table = DequantizeLinear <axis = 1, block_size = {block}> ({table_inputs})
  h = Gather <axis = 0> (table, ids)
  head = DequantizeLinear <axis = 0, block_size = {block}> ({head_inputs})
  logits = MatMul (h, head)
}}
"""


def _ids() -> dict[str, Any]:
    import numpy as np

    return {"ids": np.array([[0, 5, 2], [2, -1, 3]], dtype=np.int64)}


def _written() -> str:
    """GatherBlockQuantized and MatMulNBits already written, each with its own copy (different values)."""
    import numpy as np

    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, size=(6, 32))
    head = rng.integers(0, 256, size=(6, 2, 16))
    scales = np.round(rng.uniform(0.01, 0.5, size=(6, 2)), 4)
    values = ", ".join(str(v) for v in scales.flat)
    return f"""
<ir_version: 10, opset_import: ["" : 21, "com.microsoft" : 1]>
g (int64[2,3] ids) => (float[2,3,6] logits) <uint8[6,32] d, float[6,2] s, uint8[6,2,16] b, float[2,3,64] h> {{
  d = Constant <value = uint8[6,32] {{{", ".join(str(v) for v in data.flat)}}}> ()
  s = Constant <value = float[6,2] {{{values}}}> ()
  b = Constant <value = uint8[6,2,16] {{{", ".join(str(v) for v in head.flat)}}}> ()
  h = com.microsoft.GatherBlockQuantized <bits = 4, block_size = 32, gather_axis = 0, quantize_axis = 1> (d, ids, s)
  logits = com.microsoft.MatMulNBits <K = 64, N = 6, bits = 4, block_size = 32> (h, b, s)
}}
"""


tied_int4_table_once = OnnxRewriteRule(
    meta=RuleMeta(
        id="onnx/tied-int4-table-once",
        why="a tied int4 model stored its vocabulary matrix twice in each graph (the embedding's GatherBlockQuantized "
        "table and the head's MatMulNBits copy, each 17.7 MB with scales at the SmolLM2-135M shape); one copy "
        "read by both, as onnxruntime-genai's builder writes it, keeps the outputs identical",
        upstream="onnxruntime==1.32.0 contrib ops com.microsoft.GatherBlockQuantized (uint8 data, bits 4) and "
        "com.microsoft.MatMulNBits (the same packing, row by row)",
        backends=("onnx",),
        models=("llama", "qwen2", "qwen3", "nncf-onnx"),
        kind="optimization",
        requires=("onnx/blocked-dequantize-matmul-nbits", "onnx/blocked-dequantize-gather"),
        examples=(
            Match(lambda: (_tied(6, 64, 32, signed=True), _ids()), "a tied int4 table [6, 64], groups of 32"),
            Match(
                lambda: (_tied(6, 96, 32, signed=False), _ids()),
                "a tied uint4 table [6, 96] with zero points (3 blocks a row)",
            ),
            NoMatch(
                lambda: (_written(), _ids()),
                "a GatherBlockQuantized and a MatMulNBits holding different blocks",
                reason="no MatMulNBits holds the same 4-bit blocks, scales and zero points",
            ),
        ),
    ),
    rewrite_rule=_rule,
    phase="quantized",
)
