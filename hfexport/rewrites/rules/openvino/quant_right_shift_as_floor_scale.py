"""NNCF int4 weight compression (`NNCFTorchFXQuantizer(NNCFWeightCompressionConfig(mode="int4_*"))`) on OpenVINO.

`nncf.compress_weights` on a Torch FX graph packs two int4 weights in a byte and unpacks them in the graph with
`bitwise_and(w, 15)` and `bitwise_right_shift(w, 4)`. `openvino.convert_model` (2026.4.1) has no conversion
for `aten.bitwise_right_shift.Tensor_Scalar` in its FX table, and an integer floor division is no way around
it: on a constant u8 tensor (the packed weights are constants) OpenVINO computes `div(x, 16,
rounding_mode="floor")` rounded to nearest (9 // 16 gives 1).

A right shift of an 8-bit integer by k is floor(x / 2**k): x * 2**-k is exact in float32 (a power-of-two
scale of an integer below 2**24), `floor` of it is exact, and so is the cast back. The rule writes that, and the
examples check it on every byte value.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.fx import NodeRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules._nncf_int4 import unpack_example

aten = torch.ops.aten
_SHIFT = aten.bitwise_right_shift.Tensor_Scalar
# float32 holds every value of these exactly, and every quotient by a power of two.
_EXACT_IN_FLOAT = {torch.uint8: 8, torch.int8: 8}


def _is_byte_right_shift(node: fx.Node) -> bool:
    """`bitwise_right_shift(x, k)` on a uint8/int8 tensor by a constant 0 <= k < 8."""
    if node.op != "call_function" or node.target is not _SHIFT or node.kwargs:
        return False
    x, k = node.args
    value = x.meta.get("val") if isinstance(x, fx.Node) else None
    bits = _EXACT_IN_FLOAT.get(getattr(value, "dtype", None))
    return bits is not None and isinstance(k, int) and not isinstance(k, bool) and 0 <= k < bits


def _call(graph: fx.Graph, target: Any, args: tuple[Any, ...], like: fx.Node) -> fx.Node:
    """A call with the fake value the converter reads (dtype and shape), computed from its inputs' values."""
    node = graph.call_function(target, args)
    values = tuple(a.meta["val"] if isinstance(a, fx.Node) else a for a in args)
    node.meta = {k: v for k, v in like.meta.items() if k != "val"}
    node.meta["val"] = target(*values)
    return node


def _shift_as_floor_scale(gm: fx.GraphModule, node: fx.Node) -> None:
    """`x >> k` -> `floor(float(x) * 2**-k)` cast back to x's dtype: equal for every 8-bit value (arithmetic shift
    of a negative int8 floors too)."""
    x, k = node.args
    dtype = x.meta["val"].dtype
    graph = gm.graph
    with graph.inserting_before(node):
        real = _call(graph, aten.to.dtype, (x, torch.float32), node)
        scaled = _call(graph, aten.mul.Tensor, (real, 2.0**-k), node)
        floored = _call(graph, aten.floor.default, (scaled,), node)
        back = _call(graph, aten.to.dtype, (floored, dtype), node)
    node.replace_all_uses_with(back)
    graph.erase_node(node)


# -- examples --------------------------------------------------------------------------------------------------------


class _WideShift(torch.nn.Module):
    """A right shift of int32 values: float32 is not exact above 2**24, so the rule leaves it alone."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.bitwise_right_shift(x, 4)


quant_right_shift_as_floor_scale = NodeRule(
    RuleMeta(
        id="openvino/quant-right-shift-as-floor-scale",
        why="NNCF's int4 weights are unpacked with aten.bitwise_right_shift, which openvino.convert_model cannot "
        "convert ('No conversion rule found for operations: aten.bitwise_right_shift.Tensor_Scalar'); a shift "
        "of a byte by k is floor(x * 2**-k) in float32, exactly",
        upstream="openvino==2026.4.1 src/frontends/pytorch/src/op_table.cpp FX op table (aten::bitwise_right_shift "
        "added for TorchScript in https://github.com/openvinotoolkit/openvino/pull/29142, no "
        "aten.bitwise_right_shift.Tensor_Scalar for torch.export); the u8 floor-division alternative rounds on "
        "constants (9 // 16 == 1)",
        backends=("openvino",),
        models=("nncf-int4",),
        examples=(
            Match(
                unpack_example,
                "uint8: every byte value >> 4 (NNCF's unpacking), >> 1 and >> 7, exact",
                atol=0.0,
                rtol=0.0,
            ),
            Match(
                lambda: unpack_example(torch.int8),
                "int8: every value, arithmetic shifts of negatives, exact",
                atol=0.0,
                rtol=0.0,
            ),
            NoMatch(lambda: (_WideShift(), {"x": torch.arange(-40, 40, dtype=torch.int32)}), "an int32 shift"),
        ),
    ),
    predicate=_is_byte_right_shift,
    rewrite=_shift_as_floor_scale,
)
