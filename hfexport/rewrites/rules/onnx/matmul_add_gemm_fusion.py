"""MatMul + bias Add on matrices -> one `Gemm` (ONNX Runtime CPU fusion).

torch.onnx emits `Gemm` for `addmm` (a 2-D `F.linear`), but a bias added to a 2-D `matmul` written out
(`x @ w + b`: poolers, classifier heads, some attention projections on flattened tokens) stays MatMul +
Add. `Gemm` computes `A @ B + C` in one kernel, with `C` broadcast to the product (unidirectionally).

Valid only for matrices: `Gemm` takes 2-D A and B, so a batched MatMul (3-D activations of a decoder
layer) is left alone. Flattening it to 2-D around a Gemm is possible but measured no faster on ONNX
Runtime CPU, whose own MatMulAddFusion already handles that case (1.76 vs 1.74 ms for [1, 128, 576] @
[576, 576] + bias, see docs/onnx.md). The bias must broadcast to [M, N] without growing the result:
a vector of N, or a [1|M, 1|N] matrix.
"""

from __future__ import annotations

from typing import Any

import torch

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.onnx import OnnxRewriteRule
from hfexport.rewrites.rule import RuleMeta


def _bias_broadcasts(bias: Any, rows: Any, columns: Any) -> bool:
    """Whether `bias` broadcasts to [rows, columns] (unidirectionally: the product's shape is kept)."""
    if bias.shape is None:
        return False
    dims = list(bias.shape)
    if len(dims) == 1:
        return dims[0] == columns or dims[0] == 1
    if len(dims) == 2:
        return dims[0] in (1, rows) and dims[1] in (1, columns)
    return len(dims) == 0


def _gemm_rule() -> Any:
    import onnx_ir as ir
    from onnxscript.rewriter import pattern

    class MatMulAddToGemm(pattern.RewriteRuleClassBase):
        def pattern(self, op: Any, a: Any, b: Any, bias: Any) -> Any:
            return op.Add(op.MatMul(a, b), bias)

        def check(self, context: Any, a: Any, b: Any, bias: Any, **_: Any) -> Any:
            result = pattern.MatchResult()
            if a.dtype not in (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16):
                return result.fail(f"{a.dtype} is not a Gemm type", a)
            if bias.dtype != a.dtype:
                return result.fail("bias dtype differs", bias)
            if a.shape is None or b.shape is None or a.shape.rank() != 2 or b.shape.rank() != 2:
                return result.fail("not a product of two matrices", a)
            if not _bias_broadcasts(bias, a.shape[0], b.shape[1]):
                return result.fail(f"bias of shape {bias.shape} does not broadcast to [M, N]", bias)
            return result

        def rewrite(self, op: Any, a: Any, b: Any, bias: Any, **_: Any) -> Any:
            return op.Gemm(a, b, bias)

    return pattern.RewriteRuleSet([MatMulAddToGemm.rule()], commute=True)


# -- examples --------------------------------------------------------------------------------------


class _Head(torch.nn.Module):
    """`tanh(x @ w + b)`: a matrix or a batch of matrices `x`, bias of any shape."""

    def __init__(self, bias_shape: tuple[int, ...] = (6,)) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(5, 6, generator=generator))
        self.b = torch.nn.Parameter(torch.randn(*bias_shape, generator=generator))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x @ self.w + self.b)


def _x(*shape: int) -> dict[str, Any]:
    return {"x": torch.randn(*shape, generator=torch.Generator().manual_seed(1))}


def _vector_bias() -> Any:
    return _Head(), _x(4, 5)


def _column_bias() -> Any:
    return _Head(bias_shape=(4, 1)), _x(4, 5)


def _batched() -> Any:
    return _Head(), _x(2, 4, 5)


def _growing_bias() -> Any:
    # [3, 4, 6] + a [4, 6] product broadcasts the result up to 3-D: not a Gemm.
    return _Head(bias_shape=(3, 4, 6)), _x(4, 5)


matmul_add_gemm_fusion = OnnxRewriteRule(
    meta=RuleMeta(
        id="onnx/matmul-add-gemm-fusion",
        why="a bias added to a matrix product runs as one Gemm"
        "; measured by tools/ab_gemm_fusion.py (ONNX Runtime 1.32 CPU, 2-core AVX2 EPYC, one node "
        "against two in a model of its own): [1, 576] x [576, 576] + bias 34.9 us as Gemm against 32.0 us as "
        "MatMul + Add (0.92x), [128, 576]: 740.6 against 750.2 us (1.01x): no gain beyond the spread; it fires "
        "on no generation model measured (Llama, GPT-2, nanochat)",
        upstream="onnx==1.23.2 docs/Operators.md Gemm",
        backends=("onnx",),
        kind="optimization",
        examples=(
            Match(_vector_bias, "[4, 5] @ [5, 6] + [6]", atol=1e-5),
            Match(_column_bias, "[4, 5] @ [5, 6] + [4, 1]", atol=1e-5),
            NoMatch(_batched, "batched [2, 4, 5] @ [5, 6] + [6]"),
            NoMatch(_growing_bias, "a [3, 4, 6] bias that broadcasts the product to 3-D"),
        ),
    ),
    rewrite_rule=_gemm_rule,
)
