"""Constants the onnxscript optimizer mistakes for no-ops (stage `onnx`, a fix run before the optimizer).

The optimizer's default rewrite rules (onnxscript `rewriter/rules/common/_no_op.py`) replace `x + 0`, `x - 0`,
`x * 1` and `x / 1` by `x`. Their patterns hold the constant 0 or 1 as a pattern `Constant`, which matches a
scalar with `math.isclose(value, expected, rel_tol=1e-5, abs_tol=1e-8)`: an RMSNorm epsilon of 1e-8 (Helium's
`rms_norm_eps`) reads as 0, and `mean(x**2) + 1e-8` became `mean(x**2)`. Every normalised row then drifted
by about eps / mean(x**2) (1e-5 relative on a tiny model), and an all-zero row (the padding token's zero
embedding, fed back at a decode step) became 0 * inf = NaN where eager gives 0.

The patterns only match a rank-0 constant, so this rule gives such a constant the shape [1]: the same value,
and, against an operand of rank >= 1, the same broadcast result shape, which the no-op rules leave alone.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.onnx import OnnxRewriteRule
from hfexport.rewrites.rule import RuleMeta

# onnxscript's pattern Constant defaults (rewriter/_pattern_ir.py Constant.__init__).
_REL_TOL, _ABS_TOL = 1e-5, 1e-8
# Op -> (the identity its no-op rule looks for, whether the constant may be either operand).
_OPS = {"Add": (0.0, True), "Sub": (0.0, False), "Mul": (1.0, True), "Div": (1.0, False)}


def _near_identity(value: Any, identity: float) -> bool:
    """`value` is a float scalar constant that the no-op rule would take for `identity` but is not it."""
    import onnx_ir as ir

    tensor = ir.convenience.get_const_tensor(value)
    if tensor is None or tensor.dtype not in (
        ir.DataType.FLOAT,
        ir.DataType.DOUBLE,
        ir.DataType.FLOAT16,
        ir.DataType.BFLOAT16,
    ):
        return False
    if tensor.shape.rank() != 0:
        return False
    scalar = float(tensor.numpy().astype("float64"))
    return scalar != identity and math.isclose(scalar, identity, rel_tol=_REL_TOL, abs_tol=_ABS_TOL)


def _rules() -> Any:
    import onnx_ir as ir
    from onnxscript.rewriter import pattern

    def make(op_type: str, identity: float, constant_first: bool) -> Any:
        class NearNoop(pattern.RewriteRuleClassBase):
            def __init__(self) -> None:
                super().__init__(f"{op_type}NearNoop{'First' if constant_first else ''}")

            def pattern(self, op: Any, x: Any, c: Any) -> Any:
                return getattr(op, op_type)(c, x) if constant_first else getattr(op, op_type)(x, c)

            def check(self, context: Any, x: Any, c: Any, **_: Any) -> Any:
                result = pattern.MatchResult()
                if not _near_identity(c, identity):
                    return result.fail("not a scalar the no-op rules would take for the identity", c)
                rank = x.shape.rank() if x.shape is not None else None
                if rank is None or rank < 1:
                    # x + [c] would have shape [1] where x + c has shape [].
                    return result.fail("the other operand's rank is unknown or 0", x)
                return result

            def rewrite(self, op: Any, x: Any, c: Any, **_: Any) -> Any:
                array = ir.convenience.get_const_tensor(c).numpy().reshape(1)
                constant = op.Constant(value=ir.tensor(array))
                return getattr(op, op_type)(constant, x) if constant_first else getattr(op, op_type)(x, constant)

        return NearNoop.rule()

    rules = []
    for op_type, (identity, commutes) in _OPS.items():
        rules.append(make(op_type, identity, constant_first=False))
        if commutes:
            rules.append(make(op_type, identity, constant_first=True))
    return pattern.RewriteRuleSet(rules)


# -- examples --------------------------------------------------------------------------------------


class _RmsNorm(torch.nn.Module):
    """HeliumRMSNorm's arithmetic with its tiny epsilon."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class _Scale(torch.nn.Module):
    """A multiply by a constant a hair above 1, then a divide by one a hair below."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 1.000004) / 0.999997


def _zero_row(eps: float) -> Any:
    # Row 0 all zeros (the padding token's zero embedding); row 1 of small values, where eps is 1e-5 relative.
    x = torch.zeros(2, 1, 32)
    x[1] = 0.01 * torch.randn(1, 32, generator=torch.Generator().manual_seed(0))
    return _RmsNorm(eps), {"x": x}


def _scale() -> Any:
    return _Scale(), {"x": 1000 * torch.randn(3, 8, generator=torch.Generator().manual_seed(0))}


# ONNX text with every value typed up front: the rewriter annotates the types of a graph's Constant nodes as it
# runs, which would read as a change (see fusions_norm.py).
_EXACT_TEXT = """
<ir_version: 10, opset_import: ["" : 18]>
g (float[2,8] x) => (float[2,8] y) <float zero, float one, float big, float[2,8] a, float[2,8] b> {
  zero = Constant <value = float {0.0}> ()
  one = Constant <value = float {1.0}> ()
  big = Constant <value = float {1e-6}> ()
  a = Add(x, zero)
  b = Mul(one, a)
  y = Add(b, big)
}
"""


def _exact_identities() -> Any:
    return _EXACT_TEXT, {}


keep_near_noop_constants = OnnxRewriteRule(
    meta=RuleMeta(
        id="onnx/keep-near-noop-constants",
        why="the onnxscript optimizer drops `+ eps` for eps <= 1e-8 (and `* c` for c within 1e-5 of 1) as a no-op: "
        "Helium's RMSNorm (eps 1e-8) lost its epsilon and gave NaN on the padding token's zero embedding",
        upstream="onnxscript==0.7.2 rewriter/rules/common/_no_op.py (add_0, sub_0, mul_by_1, div_by_1) match through "
        "pattern Constant(rel_tol=1e-5, abs_tol=1e-8) in rewriter/_pattern_ir.py",
        backends=("onnx",),
        models=("helium",),
        kind="fix",
        examples=(
            Match(
                lambda: _zero_row(1e-8),
                "RMSNorm with eps 1e-8 on an all-zero row and a row of small values, then the optimizer",
                atol=0.0,
                rtol=1e-6,
            ),
            Match(_scale, "x * 1.000004 / 0.999997 on values near 1000, then the optimizer", atol=0.0, rtol=1e-7),
            NoMatch(lambda: _zero_row(1e-6), "RMSNorm with eps 1e-6: nothing mistakes it for 0"),
            NoMatch(_exact_identities, "exact + 0 and * 1 (true no-ops, left to the optimizer) and + 1e-6"),
        ),
    ),
    rewrite_rule=_rules,
)
