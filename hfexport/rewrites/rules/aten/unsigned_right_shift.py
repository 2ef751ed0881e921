"""A right shift of an unsigned tensor by a number as ONNX: one logical `BitShift`, in the operand's own dtype.

torchlib translates every right shift as an arithmetic shift of a signed integer: it casts the operand to the
unsigned type of its width, shifts logically, ORs in the sign bits where the operand is negative, and casts the
result to the *signed* type (`Cast(..., to=INT8)` for an 8-bit operand). For a uint8 operand the values are right
(a uint8 is never negative, and `x >> k` for k >= 1 fits an int8), but the output is int8 where torch's is uint8, so
the graph's types no longer agree: NNCF's int4 unpacking on Torch FX (`nncf.compress_weights` with `int4_*`,
`NNCFTorchFXQuantizer`) stacks `bitwise_and(packed, 15)` (uint8) with `bitwise_right_shift(packed, 4)` (int8 after
torchlib), and ONNX Runtime refuses the model: "Type parameter (T) of Optype (Concat) bound to different types
(tensor(uint8) and tensor(int8))". Any unsigned shift feeding an op that binds one type to several inputs (`Concat`,
`Add`, `Where`) fails the same way.

An unsigned right shift is a logical shift, which ONNX `BitShift(direction="RIGHT")` computes for uint8, uint16,
uint32 and uint64 in the operand's own dtype: the override writes that node, the same shift torchlib computes before
its casts, so the bits are torchlib's and the dtype is torch's. Signed operands keep torchlib's arithmetic shift.
torch.onnx's decompositions write `aten.bitwise_right_shift.Tensor_Scalar` (what `x >> 4` traces to) as
`aten.bitwise_right_shift.Tensor` of a `scalar_tensor` where `x` is a constant (NNCF's packed weights) and as
`aten.__rshift__.Scalar` where it is a graph input; torchlib translates both with one function, and so does the rule.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.onnx import AtenOverride
from hfexport.rewrites.rule import RuleMeta


def _unsigned_shift(self: Any, other: Any = None) -> bool:
    """An unsigned operand: the dispatches the override translates."""
    import onnx_ir as ir

    unsigned = (ir.DataType.UINT8, ir.DataType.UINT16, ir.DataType.UINT32, ir.DataType.UINT64)
    return getattr(self, "dtype", None) in unsigned


def _unsigned_shift_translation() -> Callable[..., Any]:
    import onnx_ir as ir
    from onnxscript import opset18 as op
    from onnxscript.function_libs.torch_lib.ops.core import (
        aten_bitwise_right_shift,
        aten_bitwise_right_shift_tensor_scalar,
    )

    def unwrapped(function: Any) -> Any:
        return getattr(function, "function", function)

    def aten_bitwise_right_shift_unsigned(self: Any, other: Any) -> Any:
        number = isinstance(other, int) and not isinstance(other, bool)
        if not _unsigned_shift(self, other):
            return unwrapped(aten_bitwise_right_shift_tensor_scalar if number else aten_bitwise_right_shift)(
                self, other
            )
        amount = op.Constant(value=ir.tensor(other, dtype=self.dtype)) if number else op.CastLike(other, self)
        # torchlib's own logical shift (its `shifted`), without the cast to the signed type.
        return op.BitShift(self, amount, direction="RIGHT")

    return aten_bitwise_right_shift_unsigned


# -- examples --------------------------------------------------------------------------------------------------------


class _PackedWeight(torch.nn.Module):
    """NNCF's int4 decompression of a packed weight: `packed & 15` and `packed >> 4` stacked, every byte value 64
    times (16384 bytes: above the onnxscript optimizer's folding limit, so the graph keeps the shift, as it does for
    a model's weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("packed", torch.arange(256).repeat(64).to(torch.uint8).reshape(128, 128))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nibbles = torch.stack([torch.bitwise_and(self.packed, 15), torch.bitwise_right_shift(self.packed, 4)], -1)
        return x + nibbles.reshape(128, 256).to(torch.float32)


class _InputShift(torch.nn.Module):
    """Right shifts of a uint8 graph input (`aten.__rshift__.Scalar` after torch.onnx's decompositions)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nibbles = torch.stack([torch.bitwise_and(x, 15), x >> 4], -1).reshape(x.shape[0], -1)
        return torch.cat([nibbles, x >> 1, x >> 7, x >> 0], -1).to(torch.float32)


class _SignedShift(torch.nn.Module):
    """Arithmetic right shifts of int32 values (negatives too), as floats."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.bitwise_right_shift(x, 3).to(torch.float32)


def _bytes() -> dict[str, torch.Tensor]:
    return {"x": torch.arange(256).to(torch.uint8).reshape(16, 16)}


unsigned_right_shift = AtenOverride(
    RuleMeta(
        id="aten/unsigned-right-shift",
        why="torchlib translates a right shift of a uint8 tensor with a Cast to int8, so NNCF's Torch FX int4 "
        "unpacking (a stack of `packed & 15` and `packed >> 4`) does not load in ONNX Runtime: 'Type parameter (T) "
        "of Optype (Concat) bound to different types (tensor(uint8) and tensor(int8))'; an unsigned shift is one "
        "logical BitShift in its own dtype",
        upstream="onnxscript==0.7.2 function_libs/torch_lib/ops/core.py aten_bitwise_right_shift (returns "
        "Cast(..., to=signed_dtype) for every operand, unsigned ones too); no onnxscript issue found for "
        "'bitwise_right_shift uint8' in microsoft/onnxscript",
        backends=("onnx",),
        models=("nncf-int4",),
        examples=(
            Match(
                lambda: (_PackedWeight(), {"x": torch.randn(128, 256, generator=torch.Generator().manual_seed(0))}),
                "NNCF's int4 unpacking of a packed uint8 weight (a constant): & 15 and >> 4 stacked, exact",
                atol=0.0,
                rtol=0.0,
            ),
            Match(
                lambda: (_InputShift(), _bytes()),
                "every byte value of a uint8 input >> 4 stacked with & 15, >> 1, >> 7 and >> 0, exact",
                atol=0.0,
                rtol=0.0,
            ),
            NoMatch(
                lambda: (_SignedShift(), {"x": torch.arange(-40, 40, dtype=torch.int32)}),
                "an int32 shift keeps torchlib's arithmetic shift",
                reason="only unsigned operands are translated",
            ),
        ),
    ),
    target="aten.bitwise_right_shift.Tensor",
    also=("aten.__rshift__.Scalar",),
    translation=_unsigned_shift_translation,
    counts=_unsigned_shift,
)
