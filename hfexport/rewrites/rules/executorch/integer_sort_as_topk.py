"""`sort` of integer tensors as a full `topk`: the ExecuTorch portable kernels have no sort."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_symbols

from hfexport.rewrites.examples import Built, Match, NoMatch
from hfexport.rewrites.kinds.fx import NodeRule
from hfexport.rewrites.rule import RuleMeta

_SORT = torch.ops.aten.sort.default
_SORT_STABLE = torch.ops.aten.sort.stable
_TOPK = torch.ops.aten.topk.default
_SYM_SIZE = torch.ops.aten.sym_size.int
_INTEGERS = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def _arguments(node: fx.Node) -> tuple[fx.Node, int, bool, Any]:
    """(input, dim, descending, stable) of a `sort.default(self, dim=-1, descending=False)` or
    `sort.stable(self, *, stable, dim=-1, descending=False)` call."""
    if node.target is _SORT:
        names = ("self", "dim", "descending")
        bound = dict(zip(names, node.args, strict=False)) | node.kwargs
        return bound["self"], bound.get("dim", -1), bound.get("descending", False), False
    return node.args[0], node.kwargs.get("dim", -1), node.kwargs.get("descending", False), node.kwargs.get("stable")


def _unstable_integer_sort(node: fx.Node) -> bool:
    """A sort that may order ties freely (not `stable=True`) of an integer tensor: no NaN, so a full `topk` gives
    the same values and a valid order of indices."""
    if node.op != "call_function" or node.target not in (_SORT, _SORT_STABLE):
        return False
    source, _, _, stable = _arguments(node)
    value = source.meta.get("val") if isinstance(source, fx.Node) else None
    return stable is not True and isinstance(value, torch.Tensor) and value.dtype in _INTEGERS and value.ndim > 0


def _sort_as_topk(gm: fx.GraphModule, node: fx.Node) -> None:
    """`sort(x, dim, descending)` -> `topk(x, x.size(dim), dim, largest=descending, sorted=True)`: the same
    (values, indices) pair; ties, which an unstable sort orders as it likes, come in topk's order."""
    source, dim, descending, _ = _arguments(node)
    dim = dim % source.meta["val"].ndim
    length = source.meta["val"].shape[dim]
    with gm.graph.inserting_before(node):
        if free_symbols(length):
            size = gm.graph.call_function(_SYM_SIZE, (source, dim))
            size.meta["val"] = length
        else:
            size = int(length)
        topk = gm.graph.call_function(_TOPK, (source, size, dim, bool(descending), True))
    topk.meta = dict(node.meta)
    node.replace_all_uses_with(topk)
    gm.graph.erase_node(node)


class _GroupByKey(torch.nn.Module):
    """JetMoe's routing: rows sorted by their expert id, scaled per expert, and added back to their own rows, so
    the result is the same for every order of tied ids."""

    def __init__(self, descending: bool = False, stable: bool | None = None, floats: bool = False) -> None:
        super().__init__()
        self.descending = descending
        self.stable = stable
        self.floats = floats

    def forward(self, ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        keys = ids.float() if self.floats else ids
        if self.stable is None:  # aten.sort.default
            values, order = keys.sort(0, descending=self.descending)
        else:  # aten.sort.stable
            values, order = keys.sort(dim=0, descending=self.descending, stable=self.stable)
        scaled = x[order] * (values[:, None] + 1).to(x.dtype)
        return torch.zeros_like(x).index_add(0, order, scaled)


def _rows(length: int, seed: int = 0) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "ids": torch.randint(0, 4, (length,), generator=generator),
        "x": torch.randn(length, 3, generator=generator),
    }


def _built(**kwargs: Any) -> Built:
    return _GroupByKey(**kwargs), _rows(12)


integer_sort_as_topk = NodeRule(
    RuleMeta(
        id="executorch/integer-sort-as-topk",
        why="The ExecuTorch portable kernels (and XNNPACK) have no `sort`: a program that sorts (JetMoe's router "
        "groups token rows by `top_k_experts.sort(0)`) lowers but fails to load ('Missing operator: "
        "aten::sort.values', error 0x14). A sort of an integer tensor, not asked to be stable, is the full "
        "`topk(x, x.size(dim), dim, largest=descending)`, which the portable kernels have: the same values, "
        "and indices in an order an unstable sort may give (ties in topk's order)",
        upstream="executorch==1.4.1 kernels/portable/functions.yaml: topk.values, no sort.values or argsort",
        backends=("executorch",),
        models=("jetmoe",),
        examples=(
            Match(
                lambda: _built(),
                "ids.sort(0) with ties, rows regrouped and added back, then a longer input",
                other_inputs=lambda: _rows(29, seed=1),
            ),
            Match(
                lambda: _built(descending=True),
                "ids.sort(0, descending=True), then a shorter input",
                other_inputs=lambda: _rows(5, seed=2),
            ),
            Match(
                lambda: _built(stable=False),
                "ids.sort(dim=0, stable=False) (aten.sort.stable, which to_edge refuses), then a longer input",
                other_inputs=lambda: _rows(20, seed=3),
            ),
            NoMatch(lambda: _built(stable=True), "a stable sort (ties keep their order; topk does not promise it)"),
            NoMatch(lambda: _built(floats=True), "a sort of floats (NaN order is sort's own)"),
        ),
    ),
    predicate=_unstable_integer_sort,
    rewrite=_sort_as_topk,
)
