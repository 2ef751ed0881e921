"""GELU written out with tanh -> one `Gelu(approximate="tanh")` node (ONNX Runtime CPU fusion).

GPT-2's `NewGELUActivation` (and copies: `gelu_new` in CodeGen, GPT-J, ...) spell the tanh approximation
out in Python, `0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3)))`, which torch.onnx translates
op by op (Pow, Mul, Add, Mul, Tanh, Add, Mul, Mul). It is exactly what ONNX's `Gelu` (opset 20) computes
with `approximate="tanh"`, and what ONNX Runtime's contrib `FastGelu` computes at older opsets: one
kernel instead of eight.

Only that formula fuses: `check` requires the constants to be the approximation's own (in float32), and
float32/float64 data; a float16 graph rounds after every op, which the fused kernel does not.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.onnx import OnnxRewriteRule
from hfexport.rewrites.rule import RuleMeta

_CONSTANTS = {"half": 0.5, "three": 3.0, "cubic": 0.044715, "scale": math.sqrt(2.0 / math.pi), "one": 1.0}


def _scalar(value: Any) -> float | None:
    import onnx_ir as ir

    tensor = ir.convenience.get_const_tensor(value)
    if tensor is None or tensor.size != 1:
        return None
    return float(tensor.numpy().reshape(()))


def _gelu_tanh_rules() -> Any:
    import numpy as np
    import onnx_ir as ir
    from onnxscript.rewriter import pattern

    class GeluTanh(pattern.RewriteRuleClassBase):
        def pattern(self, op: Any, x: Any, half: Any, three: Any, cubic: Any, scale: Any, one: Any) -> Any:
            inner = op.Mul(op.Add(x, op.Mul(op.Pow(x, three), cubic)), scale)
            return op.Mul(op.Mul(x, half), op.Add(op.Tanh(inner), one))

        def check(self, context: Any, x: Any, **constants: Any) -> Any:
            result = pattern.MatchResult()
            if x.dtype not in (ir.DataType.FLOAT, ir.DataType.DOUBLE):
                return result.fail(f"{x.dtype} data: the fused kernel does not round after every step", x)
            for name, expected in _CONSTANTS.items():
                actual = _scalar(constants[name])
                # Equal in float32: the exporter stores Python's constants as float32 initializers.
                if actual is None or np.float32(actual) != np.float32(expected):
                    return result.fail(f"{name} is {actual}, the tanh approximation uses {expected}", constants[name])
            return result

        def rewrite(self, op: Any, x: Any, **_: Any) -> Any:
            return op.Gelu(x, approximate="tanh")

    class FastGelu(GeluTanh):
        """Opsets before 20 have no `Gelu`: ORT's contrib FastGelu computes the same approximation."""

        def check(self, context: Any, x: Any, **constants: Any) -> Any:
            if context.model.opset_imports.get("", 0) >= 20:
                return pattern.MatchResult().fail("opset >= 20: the standard Gelu rule applies")
            return super().check(context, x, **constants)

        def rewrite(self, op: Any, x: Any, **_: Any) -> Any:
            return op.FastGelu(x, _domain="com.microsoft")

    class StandardGelu(GeluTanh):
        def check(self, context: Any, x: Any, **constants: Any) -> Any:
            if context.model.opset_imports.get("", 0) < 20:
                return pattern.MatchResult().fail("opset < 20 has no Gelu")
            return super().check(context, x, **constants)

    # torch.onnx keeps the operand order of the Python expression: commute covers `x * 0.5`, `1 + tanh`, ...
    return pattern.RewriteRuleSet([StandardGelu.rule(), FastGelu.rule()], commute=True)


# -- examples --------------------------------------------------------------------------------------


class _NewGelu(torch.nn.Module):
    """GPT-2's NewGELUActivation between two linear layers."""

    def __init__(self, cubic: float = 0.044715) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.up, self.down, self.cubic = torch.nn.Linear(16, 40), torch.nn.Linear(40, 3), cubic

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        h = 0.5 * h * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (h + self.cubic * torch.pow(h, 3.0))))
        return self.down(h)


class _SwappedOperands(torch.nn.Module):
    """The same formula with every commutative operand pair written the other way round."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 0.5) * (torch.tanh(((torch.pow(x, 3.0) * 0.044715) + x) * math.sqrt(2.0 / math.pi)) + 1.0)


def _x(*shape: int, scale: float = 3.0) -> dict[str, Any]:
    # Wide range: the tails (|x| > 3) are where a wrong constant would show.
    return {"x": scale * torch.randn(*shape, generator=torch.Generator().manual_seed(1))}


def _new_gelu() -> Any:
    return _NewGelu(), _x(2, 7, 16)


def _swapped() -> Any:
    return _SwappedOperands(), _x(3, 11)


def _other_constant() -> Any:
    return _NewGelu(cubic=0.05), _x(2, 7, 16)


def _float16() -> Any:
    return _NewGelu().half(), {"x": _x(2, 7, 16)["x"].half()}


gelu_tanh_fusion = OnnxRewriteRule(
    meta=RuleMeta(
        id="onnx/gelu-tanh-fusion",
        why="the tanh-approximated GELU written out in eight ops becomes one Gelu (FastGelu below opset 20); "
        "hfexport's own pattern: onnxscript 0.7.2's ORT fusion (ort_fusions.gelu) fuses 0 of tiny-gpt2's 2 GELUs "
        "(its pattern fixes one operand order and constant form that torch.onnx does not emit), this rule 2"
        "; measured by tools/ab_rules.py (8 layers at SmolLM2-135M's width, batch 1, 128-token "
        "prompt, 64 new tokens, ONNX Runtime 1.32 CPU, 2-core AVX2 EPYC): decode 1.01x on GPT-2 (156.5 against "
        "154.8 tok/s): no gain beyond the A/B's spread on this CPU",
        upstream="onnx==1.23.2 docs/Operators.md Gelu-20 with approximate=tanh; below opset 20 onnxruntime's contrib "
        "op com.microsoft.FastGelu",
        backends=("onnx",),
        models=("gpt2", "codegen", "gptj"),
        kind="optimization",
        examples=(
            Match(_new_gelu, "GPT-2 NewGELUActivation, inputs ~N(0, 3), opset 18 (FastGelu)", atol=1e-5),
            Match(_new_gelu, "the same at opset 23 (Gelu)", atol=1e-5, opset=23),
            Match(_swapped, "commuted operands", atol=1e-5),
            NoMatch(_other_constant, "0.05 instead of 0.044715"),
            NoMatch(_float16, "float16 model"),
        ),
    ),
    rewrite_rule=_gelu_tanh_rules,
)
