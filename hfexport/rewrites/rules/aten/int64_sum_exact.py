"""`aten.sum.dim_IntList` of an int64 tensor as ONNX: three 21-bit partial sums, exact and wrapping as torch's.

torchlib translates `sum` to ONNX `ReduceSum`, and ONNX Runtime's CPU kernel accumulates an int64 `ReduceSum`
in floating point: a sum past 2**53 is rounded and one past 2**63 saturates (`[2**62, 2**62, 2**62]` sums to
9223372036854775807; torch wraps to -4611686018427387904). BLT hashes byte n-grams with a rolling polynomial
(`(window * prime ** arange(n)).sum(-1)`, prime 1000000007, terms near 2**60) and reduces the hash modulo the
table size, so a rounded sum picks other embedding rows: its ONNX logits differ from eager by 3.9 (blt, the
tester config), while the Dynamo program is exact.

The override splits each int64 into three 21-bit pieces, `x = c0 + c1 * 2**21 + c2 * 2**42` (c0 and c1 in
[0, 2**21), c2 signed: `BitwiseAnd` and an exact `Div`), sums each piece (below 2**21 times the element count:
exact in a double for fewer than 2**32 elements) and recombines the three sums with int64 `Mul` and `Add`, which
wrap as torch's integer arithmetic does: the result equals torch's `sum` modulo 2**64, i.e. bit for bit. Every
other dtype keeps torchlib's `ReduceSum`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.onnx import AtenOverride
from hfexport.rewrites.rule import RuleMeta

_PIECE = 21  # bits per piece: 2**21 * 2**32 elements < 2**53, exact in the double ONNX Runtime sums in


def _int64_sum(self: Any, dim: Sequence[int] | int | None = None, keepdim: bool = False, dtype: int = -1) -> bool:
    """An int64 tensor summed to int64 (no other output dtype asked): the dispatches the override computes."""
    import onnx_ir as ir

    asked_int64 = dtype in (-1, None, ir.DataType.INT64, int(ir.DataType.INT64))
    return getattr(self, "dtype", None) == ir.DataType.INT64 and asked_int64 and len(self.shape or ()) > 0


def _int64_sum_translation() -> Callable[..., Any]:
    import onnx_ir as ir
    from onnxscript import opset18 as op

    def aten_sum_dim_int_list(self: Any, dim: Any = None, keepdim: bool = False, dtype: int = -1) -> Any:
        axes = None if dim is None else op.Constant(value_ints=[dim] if isinstance(dim, int) else list(dim))

        def reduce(x: Any) -> Any:
            return op.ReduceSum(x, keepdims=keepdim) if axes is None else op.ReduceSum(x, axes, keepdims=keepdim)

        if not _int64_sum(self, dim, keepdim, dtype):
            # torchlib's translation (aten_sum_dim_IntList)
            result = op.Identity(self) if len(self.shape or ()) == 0 else reduce(self)
            return result if dtype in (-1, None) else op.Cast(result, to=dtype)
        scale = op.Constant(value=ir.tensor(1 << _PIECE, dtype=ir.DataType.INT64))
        mask = op.Constant(value=ir.tensor((1 << _PIECE) - 1, dtype=ir.DataType.INT64))
        low = op.BitwiseAnd(self, mask)
        rest = op.Div(op.Sub(self, low), scale)  # exact: the difference is a multiple of 2**21
        middle = op.BitwiseAnd(rest, mask)
        high = op.Div(op.Sub(rest, middle), scale)
        return op.Add(reduce(low), op.Mul(op.Add(reduce(middle), op.Mul(reduce(high), scale)), scale))

    return aten_sum_dim_int_list


class _NgramHash(torch.nn.Module):
    """BLT's hash: a rolling polynomial over byte n-grams (`prime ** arange(n)`), modulo a table size."""

    def __init__(self, prime: int = 1000000007, group: int = 3, table: int = 30000) -> None:
        super().__init__()
        self.group, self.table = group, table
        self.register_buffer("powers", torch.tensor(prime, dtype=torch.int64) ** torch.arange(group))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        padded = torch.cat([torch.zeros_like(tokens[:, : self.group - 1]), tokens], dim=1)
        windows = padded.unfold(1, self.group, 1)
        return ((windows * self.powers).sum(-1) % self.table).float()


class _Sums(torch.nn.Module):
    def __init__(self, keepdim: bool) -> None:
        super().__init__()
        self.keepdim = keepdim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(-1, keepdim=self.keepdim) * 3


def _tokens(length: int, batch: int = 2) -> dict[str, torch.Tensor]:
    return {"tokens": torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(length))}


def _large() -> dict[str, torch.Tensor]:
    # Past 2**53, wrapping past 2**63 both ways, negatives, and a row of small values.
    rows = [[2**62, 2**62, 2**62], [-(2**62), -(2**62), -(2**62)], [2**60 + 1, 1, -5], [3, -7, 11]]
    return {"x": torch.tensor(rows, dtype=torch.int64)}


int64_sum_exact = AtenOverride(
    RuleMeta(
        id="aten/int64-sum-exact",
        why="ONNX Runtime accumulates an int64 ReduceSum in floating point: sums past 2**53 are rounded and past "
        "2**63 saturate instead of wrapping, so BLT's n-gram hash (`(window * prime ** arange(n)).sum(-1)` modulo "
        "the table size) picks other embedding rows and its ONNX logits differ by 3.9 (blt, the tester config); "
        "int64 sums are taken as three 21-bit partial sums recombined in int64: bit-identical to torch",
        upstream="onnxruntime==1.32.0 core/providers/cpu/reduction/reduction_ops.cc ReduceSum (int64 accumulated "
        "in floating point); onnxscript==0.7.2 torch_lib aten_sum_dim_IntList (ReduceSum for every dtype)",
        backends=("onnx",),
        models=("blt",),
        examples=(
            Match(
                lambda: (_NgramHash(), _tokens(9)),
                "BLT's 3-gram hash with prime 1000000007 (terms near 2**60), 9 tokens; then 14 tokens, batch 3",
                other_inputs=lambda: _tokens(14, 3),
            ),
            Match(lambda: (_Sums(keepdim=True), _large()), "int64 sums past 2**53 and 2**63 (wrapping), keepdim"),
            NoMatch(
                lambda: (_Sums(keepdim=False), {"x": torch.randn(2, 5)}),
                "a float sum keeps ReduceSum",
                reason="only int64 sums are split",
            ),
        ),
    ),
    target="aten.sum.dim_IntList",
    translation=_int64_sum_translation,
    counts=_int64_sum,
)
