"""A MatMul of a blockwise int4 `DequantizeLinear` of a constant weight becomes ONNX Runtime's `MatMulNBits`
(stage `onnx`, after the quantizer).

NNCF's ONNX weight compression writes int4 weights in groups in one of two forms, chosen by the model's opset
(`ONNXWeightCompressionAlgoBackend.transform_model`, nncf 3.4): below opset 21 a `MatMulNBits` (ONNX Runtime's
contrib op, replacing the MatMul), from opset 21 on a standard `DequantizeLinear(q, scale[, zero_point], axis=0,
block_size=g)` of an INT4/UINT4 initializer [K, N] feeding the MatMul. `NNCFOnnxQuantizer` used to cap the export
at opset 20 for the first form, which also cut off every fusion that writes an opset-23 op (`RotaryEmbedding`,
the `Attention` that `onnx/attention-drop-repeat-kv` and `onnx/attention-as-matmul` start from). Exported at the
newest opset instead, the second form reaches ONNX Runtime, whose session optimizer fuses it into a
`MatMulNBits` with `accuracy_level=4` (activations quantized to int8 per block: other numbers than the opset-20
export's `accuracy_level=0`).

The rule writes the `MatMulNBits` NNCF writes below opset 21 itself: the same int4 values repacked into its
layout (B: [N, blocks, g/2] bytes, two values a byte, the lower k in the low nibble; scales [N, blocks]; zero
points two blocks a byte; symmetric INT4 values stored +8 with the op's default zero point 8), `accuracy_level=0`
(dequantize in float, float accumulation) unless the export's quantizer recorded another level on the model
(`NNCFOnnxQuantizer(accuracy_level=4)`: activations quantized to int8 per block, as ONNX Runtime's own fusion and
onnxruntime-genai's builder do). Dequantizing `(q - zero_point) * scale` per block is what
`DequantizeLinear` is defined by, so the product is the same up to the order of the float sums. A K that is not a
multiple of the group is padded with zeros in the last block (the op reads K values of it).
"""

from __future__ import annotations

from typing import Any

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.onnx import OnnxRewriteRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.onnx._quantized import (
    accuracy_level,
    dequantize_inputs,
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
        """The tensor of an initializer or a Constant node's output, else None."""
        return ir.convenience.get_const_tensor(value)

    class BlockedDequantizeMatMulNBits(pattern.RewriteRuleClassBase):
        accuracy_level = 0

        def pattern(self, op: Any, a: Any, quantized: Any) -> Any:
            weight = op.DequantizeLinear(
                quantized, _allow_other_inputs=True, _allow_other_attributes=True, _outputs=["weight"]
            )
            return op.MatMul(a, weight)

        def check(self, context: Any, a: Any, quantized: Any, weight: Any, **_: Any) -> Any:
            result = pattern.MatchResult()
            dequantize = weight.producer()
            scale, zero_point, block = dequantize_inputs(dequantize)
            failure = int4_weight_failure(quantized, block, "weight")
            if failure:
                return result.fail(failure, quantized)
            if int_attribute(dequantize, "axis", 1) not in (0, -2):
                return result.fail("blocks along the columns (axis 1), not along K", weight)
            k, n = quantized.shape
            failure = int4_parts_failure(quantized, scale, zero_point, (-(-k // block), n))
            if failure:
                return result.fail(failure, weight)
            if a.dtype != ir.DataType.FLOAT:
                return result.fail("not float32 activations", a)
            if a.shape is None or a.shape.rank() < 2:
                return result.fail("activations of unknown rank or rank 1", a)
            # What the export's quantizer asked the op to compute in (0 unless it says; read here, where the model
            # is at hand, for the rewrite that follows).
            self.accuracy_level = accuracy_level(context.model)
            return result

        def rewrite(self, op: Any, a: Any, quantized: Any, weight: Any, **_: Any) -> Any:
            scale, zero_point, block = dequantize_inputs(weight.producer())
            k, n = quantized.shape
            b, scales, zeros = pack_matmul_nbits(
                constant(quantized).numpy().astype(np.int16),
                constant(scale).numpy(),
                None if zero_point is None else constant(zero_point).numpy().astype(np.int16),
                block,
            )
            initializer = initializer_maker(op, quantized.graph)
            inputs = [a, initializer(b, f"{quantized.name}.nbits"), initializer(scales, f"{scale.name}.nbits")]
            if zeros is not None:
                inputs.append(initializer(zeros, f"{zero_point.name}.nbits"))
            return op.MatMulNBits(
                *inputs, K=k, N=n, bits=4, block_size=block, accuracy_level=self.accuracy_level, _domain="com.microsoft"
            )

    return BlockedDequantizeMatMulNBits.rule()


# -- examples: ONNX text models as NNCF writes them at opset 21 and up (int4 weights as Constant nodes) --------


def _weights(k: int, n: int, block: int, signed: bool, seed: int = 0) -> tuple[list[int], list[float], list[int]]:
    import numpy as np

    rng = np.random.default_rng(seed)
    blocks = -(-k // block)
    low, high = (-8, 8) if signed else (0, 16)
    values = rng.integers(low, high, size=(k, n)).tolist()
    scales = np.round(rng.uniform(0.01, 0.5, size=(blocks, n)), 4).tolist()
    zeros = rng.integers(0, 16, size=(blocks, n)).tolist()
    return values, scales, zeros


def _flat(rows: list[list[Any]]) -> str:
    return ", ".join(str(v) for row in rows for v in row)


def _model(k: int, n: int, block: int, signed: bool, axis: int = 0) -> str:
    values, scales, zeros = _weights(k, n, block, signed)
    if axis == 1:  # blocks along N: a scale per row of K and group of columns
        scales = _weights(n, k, block, signed)[1]
        scales = [list(row) for row in zip(*scales, strict=True)]
    blocks = len(scales)
    kind = "int4" if signed else "uint4"
    constants = {
        "q": f"{kind}[{k},{n}] {{{int4_literal(values)}}}",
        "scale": f"float[{blocks},{len(scales[0])}] {{{_flat(scales)}}}",
    }
    inputs = "q, scale"
    if not signed:
        constants["zero"] = f"uint4[{blocks},{n}] {{{int4_literal(zeros)}}}"
        inputs += ", zero"
    declared = ", ".join(f"{value.split(' {')[0]} {name}" for name, value in constants.items())
    nodes = "\n".join(f"  {name} = Constant <value = {value}> ()" for name, value in constants.items())
    return f"""
<ir_version: 10, opset_import: ["" : 21, "com.microsoft" : 1]>
g (float[2,3,{k}] x) => (float[2,3,{n}] y) <{declared}, float[{k},{n}] w> {{
{nodes}
  w = DequantizeLinear <axis = {axis}, block_size = {block}> ({inputs})
  y = MatMul (x, w)
}}
"""


def _feeds(k: int) -> Any:
    def feeds() -> dict[str, Any]:
        import numpy as np

        return {"x": np.random.default_rng(1).standard_normal((2, 3, k)).astype(np.float32)}

    return feeds


blocked_dequantize_matmul_nbits = OnnxRewriteRule(
    meta=RuleMeta(
        id="onnx/blocked-dequantize-matmul-nbits",
        why="NNCFOnnxQuantizer capped int4 exports at opset 20 (where NNCF writes MatMulNBits), which cut off "
        "onnx/rotary-embedding-fusion, onnx/attention-drop-repeat-kv and onnx/attention-as-matmul (opset-23 ops): "
        "the 30-layer SmolLM2-135M int4 decode step spent 57 % of its node time in unfused rotary, repeat_kv's "
        "Expand of the cache and the decomposed attention (ORT profile, docs/benchmarks.md). At the newest opset "
        "NNCF writes DequantizeLinear(int4, block_size) + MatMul, which ONNX Runtime fuses into MatMulNBits with "
        "accuracy_level 4 (int8 activations): this rule writes NNCF's opset-20 MatMulNBits (accuracy_level 0) "
        "instead, byte for byte (2-layer SmolLM2 shape: 15 of 15 identical), so the export gets the fusions and "
        "keeps the int4 numbers (logits vs the opset-20 export: 3.1e-06 max, same greedy tokens). 8-layer decode "
        "step, 1 ORT thread, cache 256, per-node medians: non-MatMulNBits node time 2.33 -> 1.88 ms (Split, Neg, "
        "Equal, repeat_kv's Expand gone; Where 0.13 -> 0.01 ms); bench_generate 8 layers at load 4.2-4.7: "
        "98.2 -> 125.8 tok/s",
        upstream="nncf==3.4.0 nncf/quantization/algorithms/weight_compression/onnx_backend.py transform_model "
        "(MatMulNBits below opset 21, blocked DequantizeLinear from 21); onnxruntime==1.32.0 "
        "onnxruntime/core/optimizer/qdq_transformer/selectors_actions/qdq_selector_action_transformer.cc "
        "(DQ + MatMul -> MatMulNBits, session.qdq_matmulnbits_accuracy_level defaults to 4)",
        backends=("onnx",),
        models=("llama", "nncf-onnx"),
        kind="optimization",
        examples=(
            Match(
                lambda: (_model(64, 24, 32, signed=True), _feeds(64)()),
                "int4 [64, 24] weight in groups of 32, symmetric (no zero point)",
            ),
            Match(
                lambda: (_model(48, 10, 16, signed=False), _feeds(48)()),
                "uint4 [48, 10] in groups of 16 with zero points (3 blocks: odd count of zero points a row)",
            ),
            Match(
                lambda: (_model(40, 8, 16, signed=True), _feeds(40)()),
                "K = 40, not a multiple of the group of 16: the last block padded",
            ),
            NoMatch(
                lambda: (_model(32, 32, 16, signed=True, axis=1), _feeds(32)()),
                "blocks along the columns (axis 1)",
                reason="blocks along the columns (axis 1), not along K",
            ),
        ),
    ),
    rewrite_rule=_rule,
    phase="quantized",
)
