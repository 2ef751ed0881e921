"""`prims.erf_inv` (torch.erfinv after torch.onnx's decomposition) as ONNX: torch's own algorithm, op for op."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.onnx import AtenOverride
from hfexport.rewrites.rule import RuleMeta

# torch's calc_erfinv (ATen/native/Math.h, after Gary L. Pavlis' erfinv): rational initial guess, central range
# |y| <= 0.7 and tails, then two Newton-Raphson steps on erf.
_A = (0.886226899, -1.645349621, 0.914624893, -0.140543331)
_B = (-2.118377725, 1.442710462, -0.329097515, 0.012229801)
_C = (-1.970840454, -1.624906493, 3.429567803, 1.641345311)
_D = (3.543889200, 1.637067800)


def _erf_inv_translation() -> Callable[..., Any]:
    from onnxscript import opset18 as op

    def aten_erf_inv(self: Any) -> Any:
        y = self

        def c(value: float) -> Any:
            return op.CastLike(value, y)

        def poly(z: Any, coefficients: tuple[float, ...]) -> Any:
            # Horner from the highest coefficient, as torch writes it.
            result = c(coefficients[-1])
            for coefficient in reversed(coefficients[:-1]):
                result = op.Add(op.Mul(result, z), c(coefficient))
            return result

        y_abs = op.Abs(y)
        z = op.Mul(y, y)
        central = op.Div(op.Mul(y, poly(z, _A)), op.Add(op.Mul(poly(z, _B), z), c(1.0)))
        # The tail's log sees only |y| > 0.7 (elsewhere a harmless 1 - 0.7 stands in).
        tail_abs = op.Where(op.Greater(y_abs, c(0.7)), y_abs, c(0.7))
        t = op.Sqrt(op.Neg(op.Log(op.Div(op.Sub(c(1.0), tail_abs), c(2.0)))))
        signed = op.Where(op.Less(y, c(0.0)), op.Neg(poly(t, _C)), poly(t, _C))  # copysign(num, y)
        tail = op.Div(signed, op.Add(op.Mul(op.Add(op.Mul(c(_D[1]), t), c(_D[0])), t), c(1.0)))
        x = op.Where(op.LessOrEqual(y_abs, c(0.7)), central, tail)
        two_over_sqrt_pi = c(2.0 / math.sqrt(math.pi))
        for _ in range(2):
            x = op.Sub(x, op.Div(op.Sub(op.Erf(x), y), op.Mul(two_over_sqrt_pi, op.Exp(op.Neg(op.Mul(x, x))))))
        # |y| == 1: copysign(inf, y); |y| > 1: NaN (a NaN y stays NaN through the arithmetic above).
        infinity = op.Where(op.Less(y, c(0.0)), c(float("-inf")), c(float("inf")))
        x = op.Where(op.Equal(y_abs, c(1.0)), infinity, x)
        return op.Where(op.Greater(y_abs, c(1.0)), c(float("nan")), x)

    return aten_erf_inv


class _ErfInv(torch.nn.Module):
    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return torch.erfinv(y) * 2


class _Erf(torch.nn.Module):
    def forward(self, y: torch.Tensor) -> torch.Tensor:
        return torch.erf(y) * 2


class _GaussianThreshold(torch.nn.Module):
    """Gemma 3n's activation sparsity: the normal quantile of a constant target sparsity (icdf = erfinv)."""

    def __init__(self, sparsity: float = 0.95) -> None:
        super().__init__()
        self.sparsity = sparsity

    def forward(self, gate: torch.Tensor) -> torch.Tensor:
        target = torch.tensor(self.sparsity, dtype=torch.float32, device=gate.device)
        multiplier = torch.distributions.normal.Normal(0, 1).icdf(target).type(gate.dtype)
        cutoff = gate.mean(-1, keepdim=True) + gate.std(-1, keepdim=True, unbiased=False) * multiplier
        return torch.relu(gate - cutoff)


def _edges(count: int = 7) -> dict[str, torch.Tensor]:
    """-1, 1, 0, the ends' neighbours, the 0.7 switch, out of range, NaN, then an odd-sized random spread."""
    special = torch.tensor(
        [-1.0, 1.0, 0.0, -0.0, 0.7, -0.7, 0.70001, 0.99999, -0.99999, 1 - 2**-24, -(1 - 2**-24), 1.5, -3.0, 1e-30]
    )
    special = torch.cat([special, torch.tensor([float("nan")])])
    spread = torch.rand(count, generator=torch.Generator().manual_seed(0)) * 2 - 1
    return {"y": torch.cat([special, spread]).reshape(1, -1)}


def _gate(seed: int = 0, length: int = 5) -> dict[str, torch.Tensor]:
    return {"gate": torch.randn(2, length, 16, generator=torch.Generator().manual_seed(seed))}


erf_inv = AtenOverride(
    RuleMeta(
        id="aten/erf-inv",
        why="Gemma 3n's activation sparsity takes the normal quantile of its target sparsity "
        "(`Normal(0, 1).icdf`, i.e. torch.erfinv), which torch.onnx decomposes to prims.erf_inv and has no ONNX "
        "function for ('No ONNX function found for prims.erf_inv', causal_lm/gemma3n_text); the override "
        "computes torch's own calc_erfinv (rational guess + two Newton steps on Erf) in ONNX ops",
        upstream="torch==2.13.0 onnx/_internal/exporter/_torchlib and onnxscript==0.7.2 torch_lib have no "
        "aten::erfinv / prims::erf_inv",
        backends=("onnx",),
        models=("gemma3n_text",),
        examples=(
            Match(
                lambda: (_ErfInv(), _edges()),
                "±1, ±0, 0.7, near the ends, out of range, NaN, random; then another length",
                other_inputs=lambda: _edges(count=30),
            ),
            Match(lambda: (_GaussianThreshold(), _gate()), "Gemma 3n's gaussian top-k threshold"),
            NoMatch(lambda: (_Erf(), {"y": torch.linspace(-2, 2, 9)[None]}), "erf, not its inverse"),
        ),
    ),
    target="prims.erf_inv.default",
    translation=_erf_inv_translation,
)
