"""Integer arithmetic on symbolic sizes that the OpenVINO PyTorch frontend has no translator for.

The frontend translates `operator.add`, `sub`, `mul`, `floordiv`, `neg` (and `getitem`) on `SymInt` values,
but not `operator.mod` nor `torch.sym_min` / `torch.sym_max` ("No conversion rule found for operations").
These rules rewrite them with the supported operators into expressions that are equal for every integer
(Python semantics: `//` floors), so nothing depends on the sizes seen at capture. Floor division is what
the frontend computes for `operator.floordiv` (checked by the examples on negative operands).
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.nn.functional as F
from torch import fx

from hfexport.rewrites.declines import Declined
from hfexport.rewrites.examples import Match


def _int_value(arg: Any) -> Any:
    """The int / SymInt an argument stands for, or None when it is not an integer."""
    value = arg.meta.get("val") if isinstance(arg, fx.Node) else arg
    if isinstance(value, bool):
        return None
    return value if isinstance(value, (int, torch.SymInt)) else None


def on_ints(node: fx.Node, targets: tuple[Any, ...]) -> bool:
    return (
        node.op == "call_function"
        and node.target in targets
        and len(node.args) == 2
        and not node.kwargs
        and all(_int_value(a) is not None for a in node.args)
    )


def _call(graph: fx.Graph, op: Any, *args: Any) -> fx.Node:
    """An `operator` call on ints with its `val` meta (the exported program keeps one per node)."""
    node = graph.call_function(op, args)
    node.meta["val"] = op(*(_int_value(a) for a in args))
    return node


def _replace(node: fx.Node, new: fx.Node) -> None:
    node.replace_all_uses_with(new)
    node.graph.erase_node(node)


# -- a % b ------------------------------------------------------------------------------------------


def mod_to_floordiv(gm: fx.GraphModule, node: fx.Node) -> None:
    a, b = node.args
    graph = gm.graph
    with graph.inserting_before(node):
        # Python's identity a == (a // b) * b + a % b, with // flooring: holds for every int a and b != 0.
        quotient = _call(graph, operator.floordiv, a, b)
        _replace(node, _call(graph, operator.sub, a, _call(graph, operator.mul, quotient, b)))


class PadToMultiple(torch.nn.Module):
    """Right-pad the length to a multiple of 4, the Mamba-2 chunk padding `(-L) % chunk` (negative operand)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = (-x.shape[1]) % 4
        return F.pad(x, (0, 0, 0, pad)).reshape(x.shape[0], -1, 4, x.shape[2]).sum(2)


class ModOfSum(torch.nn.Module):
    """A positive operand and a symbolic divisor: `(L + 3) % B` sizes a slice."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x[:, : (x.shape[1] + 3) % y.shape[0]] * 2


# -- torch.sym_min / torch.sym_max ------------------------------------------------------------------


def min_max_to_floordiv(gm: fx.GraphModule, node: fx.Node) -> None:
    a, b = node.args
    graph = gm.graph
    with graph.inserting_before(node):
        d = _call(graph, operator.sub, a, b)
        # For every int d: d // (d*d + 1) is -1 when d < 0 and 0 otherwise (|d| < d*d + 1), so
        # below = [a < b] and min(a, b) = b + d * below, max(a, b) = a - d * below.
        square = _call(graph, operator.add, _call(graph, operator.mul, d, d), 1)
        below = _call(graph, operator.neg, _call(graph, operator.floordiv, d, square))
        shift = _call(graph, operator.mul, d, below)
        if node.target is torch.sym_min:
            new = _call(graph, operator.add, b, shift)
        else:
            new = _call(graph, operator.sub, a, shift)
    _replace(node, new)


class TopKOfAtMost(torch.nn.Module):
    """`topk(x, min(k, L))`: the indexer of axk2 keeps at most `k` keys of a sequence of any length."""

    def __init__(self, k: int = 4) -> None:
        super().__init__()
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.topk(x, min(self.k, x.shape[-1]), dim=-1).values


class MinMaxOfSizes(torch.nn.Module):
    """Two symbolic sizes: min and max of them size two slices."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        short, long = min(x.shape[0], y.shape[0]), max(x.shape[0], y.shape[0])
        return x[:short] + y[:short], torch.cat([x, y])[:long] * 2


# -- math.ceil of a size ratio --------------------------------------------------------------------------

# Exactness bound: a Python float holds every integer below 2**53 exactly.
_EXACT_INT = 2**53
# A fraction's numerator above this would leave exactness only for sizes below 2**32 (see `ceil_operands`).
_MAX_NUMERATOR = 2**21


def _sym_float_of_int(arg: Any) -> Any:
    """The int argument of a `torch.sym_float(n)` node, or None."""
    if isinstance(arg, fx.Node) and arg.op == "call_function" and arg.target is torch.sym_float and len(arg.args) == 1:
        return arg.args[0] if _int_value(arg.args[0]) is not None else None
    return None


def ceil_to_rewrite(node: fx.Node) -> bool | Declined:
    """The node predicate of a rule that rewrites `math.ceil` on sizes: `ceil_operands` finds its operands; a ceil
    it must leave (see `ceil_operands`) is declined with the reason, so the audit says why the save or conversion
    failing on it was not fixed."""
    operands = ceil_operands(node)
    if isinstance(operands, str):
        return Declined(operands)
    return isinstance(operands, tuple)


def ceil_operands(node: fx.Node) -> tuple[Any, int | Any, Any] | str | None:
    """What `math.ceil(x)` divides, as `(n, p, q)` with ceil(x) == ceil(n * p / q) for every int n the graph
    can see; a reason string when the node is a ceil of a size this rule cannot make exact; None otherwise.

    Two shapes reach `math.ceil` from sizes: `n / d` on ints (a true division; its double is the exact
    quotient rounded, which never crosses an integer while |n| < 2**53, since a non-integer quotient is at
    least 1/|d| away from one), and `f * float(n)` for a float constant f. Every finite float is p / 2**k
    exactly, and `f * n` is then exact while |n * p| < 2**53, so the integer ceiling equals Python's.
    """
    if node.op != "call_function" or node.target is not math.ceil or len(node.args) != 1:
        return None
    x = node.args[0]
    if not isinstance(x, fx.Node) or x.op != "call_function" or len(x.args) != 2:
        return None
    a, b = x.args
    if x.target is operator.truediv and _int_value(a) is not None and _int_value(b) is not None:
        return a, 1, b
    if x.target is operator.mul:
        for factor, other in ((a, b), (b, a)):
            n = _sym_float_of_int(other)
            if n is None or not isinstance(factor, float):
                continue
            if not math.isfinite(factor):
                return f"ceil of a size times {factor!r} is not an integer size"
            p, q = factor.as_integer_ratio()
            if abs(p) > _MAX_NUMERATOR:
                return f"{factor!r} is {p}/{q}: the integer ceiling equals the float one only for small sizes"
            return n, p, q
    return None


def ceil_to_int(gm: fx.GraphModule, node: fx.Node) -> None:
    n, p, q = ceil_operands(node)  # type: ignore[misc]
    graph = gm.graph
    with graph.inserting_before(node):
        # ceil(n * p / q) == -((-(n * p)) // q) for every int and q != 0, with // flooring (Python semantics,
        # which exact-int-floor-divide keeps on the CPU plugin for the negative dividend).
        scaled = n if p == 1 else _call(graph, operator.mul, n, p)
        new = _call(graph, operator.neg, _call(graph, operator.floordiv, _call(graph, operator.neg, scaled), q))
    ratio = node.args[0]
    _replace(node, new)
    # The float chain that fed the ceiling is dead now; the frontend has no translator for it either.
    for dead in (ratio, *(a for a in ratio.args if isinstance(a, fx.Node))):
        if dead.op == "call_function" and not dead.users:
            graph.erase_node(dead)


class BlocksOfLength(torch.nn.Module):
    """`nblocks = math.ceil(seq_len / window)`: pad a length to whole blocks of 4 (BigBird/LongT5-style)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        blocks = math.ceil(x.shape[1] / 4)
        return F.pad(x, (0, 0, 0, blocks * 4 - x.shape[1])).reshape(x.shape[0], blocks, 4, x.shape[2]).sum(2)


class _CapacityOfTokens(torch.nn.Module):
    """`math.ceil(fraction * tokens)` bounds a cumulative count, as NLLB-MoE's expert capacity does."""

    def __init__(self, fraction: float) -> None:
        super().__init__()
        self.fraction = fraction

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        capacity = math.ceil(self.fraction * x.shape[0])
        return torch.lt(torch.arange(x.shape[0] * 2), capacity) * 1.0


# -- integer floor division on the CPU plugin -------------------------------------------------------


def _is_python_int_divide(op: Any) -> bool:
    if op.get_type_name() != "Divide" or not op.get_attributes().get("m_pythondiv", False):
        return False
    if not op.get_output_element_type(0).is_integral_number():
        return False
    # Already exact: the dividend is a - floor_mod(a, b), a multiple of b (this rule's own output).
    dividend = op.input_value(0).get_node()
    return not (
        dividend.get_type_name() == "Subtract" and dividend.input_value(1).get_node().get_type_name() == "FloorMod"
    )


def exact_floor_divides(model: Any) -> int:
    import openvino.opset13 as ops

    divides = [op for op in model.get_ordered_ops() if _is_python_int_divide(op)]
    for op in divides:
        a, b = op.input_value(0), op.input_value(1)
        # floor(a / b) = (a - floor_mod(a, b)) / b: the division is exact, so truncating or flooring agree.
        exact = ops.divide(ops.subtract(a, ops.floor_mod(a, b)), b)
        exact.set_friendly_name(op.get_friendly_name())
        op.output(0).replace(exact.output(0))
    if divides:
        model.validate_nodes_and_infer_types()
    return len(divides)


class ShortenByCeil(torch.nn.Module):
    """Keep L + (-L) // 4 positions: a floor division of a negative size (L = 7 keeps 5, truncation 6)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, : x.shape[1] + (-x.shape[1]) // 4] * 2


class IntFloorDivide(torch.nn.Module):
    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.floor_divide(a, b)


class FloatDivide(torch.nn.Module):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.floor_divide(x, y) + x / y


def signed_ints(seed: int, n: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    b = torch.randint(1, 9, (n,), generator=generator) * torch.where(torch.arange(n) % 2 == 0, 1, -1)
    return {"a": torch.randint(-50, 50, (n,), generator=generator), "b": b}


# The expert-capacity examples both ceil rules run (fx/sym-ceil-to-int for saving, openvino/sym-ceil-to-int for
# conversion): a fraction whose product with the token count is fractional, then NLLB-MoE's default of 1.0.
CAPACITY_EXAMPLES = (
    Match(
        lambda: (_CapacityOfTokens(0.75), {"x": torch.randn(7, 3)}),
        "ceil(0.75 * tokens) for 7 tokens (5.25 -> 6); then 8 (exactly 6)",
        other_inputs=lambda: {"x": torch.randn(8, 3)},
    ),
    Match(
        lambda: (_CapacityOfTokens(1.0), {"x": torch.randn(5, 3)}),
        "NLLB-MoE's default fraction 1.0; then 11 tokens",
        other_inputs=lambda: {"x": torch.randn(11, 3)},
    ),
)
