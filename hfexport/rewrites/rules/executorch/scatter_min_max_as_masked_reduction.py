"""`scatter_reduce(..., "amin" / "amax")` along a 1-D tensor as a masked reduction: the ExecuTorch portable kernels
have no `scatter_reduce`."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_symbols

from hfexport.rewrites.examples import Built, Match, NoMatch
from hfexport.rewrites.kinds.fx import NodeRule, fill_missing_values
from hfexport.rewrites.rule import RuleMeta

_SCATTER_REDUCE = torch.ops.aten.scatter_reduce.two
_OPS = torch.ops.aten


def _arguments(node: fx.Node) -> dict[str, Any]:
    names = ("self", "dim", "index", "src", "reduce")
    bound = dict(zip(names, node.args, strict=False)) | dict(node.kwargs)
    bound.setdefault("include_self", True)
    return bound


def _vector_min_max(node: fx.Node) -> bool:
    """A float `scatter_reduce` with `amin` or `amax` of 1-D tensors (tapas' segment min / max)."""
    if node.op != "call_function" or node.target is not _SCATTER_REDUCE:
        return False
    bound = _arguments(node)
    values = [bound[k].meta.get("val") if isinstance(bound[k], fx.Node) else None for k in ("self", "index", "src")]
    if not all(isinstance(v, torch.Tensor) and v.ndim == 1 for v in values):
        return False
    return (
        bound["reduce"] in ("amin", "amax") and values[0].dtype.is_floating_point and values[2].dtype == values[0].dtype
    )


def _size(gm: fx.GraphModule, tensor: fx.Node) -> Any:
    length = tensor.meta["val"].shape[0]
    if not free_symbols(length):
        return int(length)
    size = gm.graph.call_function(_OPS.sym_size.int, (tensor, 0))
    size.meta["val"] = length
    return size


def _as_masked_reduction(gm: fx.GraphModule, node: fx.Node) -> None:
    """out[i] = min (max) of src[j] over the j with index[j] == i: a [len(out), len(src)] mask of `index == i`, src
    where the mask holds and +inf (-inf) elsewhere, reduced along the source axis; with `include_self` also
    self[i], and without it self[i] where no source lands (as scatter_reduce leaves it)."""
    bound = _arguments(node)
    this, index, src = bound["self"], bound["index"], bound["src"]
    minimum = bound["reduce"] == "amin"
    dtype = this.meta["val"].dtype
    graph = gm.graph
    with graph.inserting_before(node):
        targets = graph.call_function(
            _OPS.arange.default,
            (_size(gm, this),),
            {"dtype": index.meta["val"].dtype, "device": index.meta["val"].device},
        )
        mask = graph.call_function(
            _OPS.eq.Tensor,
            (
                graph.call_function(_OPS.unsqueeze.default, (targets, 1)),
                graph.call_function(_OPS.unsqueeze.default, (index, 0)),
            ),
        )
        fill = graph.call_function(
            _OPS.scalar_tensor.default, (float("inf") if minimum else float("-inf"),), {"dtype": dtype}
        )
        spread = graph.call_function(
            _OPS.where.self, (mask, graph.call_function(_OPS.unsqueeze.default, (src, 0)), fill)
        )
        reduced = graph.call_function(_OPS.amin.default if minimum else _OPS.amax.default, (spread, [1]))
        if bound["include_self"]:
            result = graph.call_function(_OPS.minimum.default if minimum else _OPS.maximum.default, (this, reduced))
        else:
            landed = graph.call_function(_OPS.any.dim, (mask, 1))
            result = graph.call_function(_OPS.where.self, (landed, reduced, this))
    result.meta = {k: v for k, v in node.meta.items() if k != "val"}
    node.replace_all_uses_with(result)
    graph.erase_node(node)
    fill_missing_values(gm)  # later rules and the lowering read the new nodes' shapes


class _SegmentMinMax(torch.nn.Module):
    """tapas' `_segment_reduce`: the minimum (maximum) of the values of each segment, 0 for an empty segment."""

    def __init__(self, reduce: str = "amin", include_self: bool = False, segments: int = 6) -> None:
        super().__init__()
        self.reduce = reduce
        self.include_self = include_self
        self.segments = segments

    def forward(self, values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        batch = values.shape[0]
        flat = (index + torch.arange(batch)[:, None] * self.segments).reshape(-1)
        out = torch.zeros(batch * self.segments, dtype=values.dtype)
        return out.scatter_reduce(0, flat, values.reshape(-1), reduce=self.reduce, include_self=self.include_self)


def _segments(batch: int, length: int, seed: int = 0, segments: int = 6) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    # Segment ids below `segments - 1`: the last segment of every row stays empty.
    return {
        "values": torch.randn(batch, length, generator=generator),
        "index": torch.randint(0, segments - 1, (batch, length), generator=generator),
    }


def _built(**kwargs: Any) -> Built:
    return _SegmentMinMax(**kwargs), _segments(2, 7)


scatter_min_max_as_masked_reduction = NodeRule(
    RuleMeta(
        id="executorch/scatter-min-max-as-masked-reduction",
        why="The ExecuTorch portable kernels have no `scatter_reduce`: tapas' segment minimum "
        "(`zeros.scatter_reduce(0, index, values, 'amin', include_self=False)`, for its per-cell position ids) lowers "
        "but the program fails to load ('Missing operator: aten::scatter_reduce.two_out', error 0x14). For 1-D "
        "float tensors and `amin` / `amax` the same result is a masked reduction (`index == i` over a [len(out), "
        "len(src)] mask, amin / amax along the sources, `self` kept where no source lands); quadratic in the "
        "length, which tapas' segments (one per table cell of a row) keep small",
        upstream="executorch==1.4.1 kernels/portable/functions.yaml: scatter.src_out, scatter_add.out, no "
        "scatter_reduce.two_out",
        backends=("executorch",),
        models=("tapas",),
        examples=(
            Match(
                lambda: _built(),
                "segment amin with include_self=False and an empty segment, then another batch and length",
                other_inputs=lambda: _segments(3, 11, seed=1),
            ),
            Match(
                lambda: _built(reduce="amax", include_self=True),
                "segment amax with include_self=True (zeros count), then a shorter input",
                other_inputs=lambda: _segments(1, 4, seed=2),
            ),
            NoMatch(lambda: _built(reduce="sum"), "a segment sum (not a min or max)"),
        ),
    ),
    predicate=_vector_min_max,
    rewrite=_as_masked_reduction,
)
