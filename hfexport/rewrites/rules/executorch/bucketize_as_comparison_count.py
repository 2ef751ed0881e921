"""Rule `executorch/bucketize-as-comparison-count`: `bucketize` through the ExecuTorch edge dialect."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from hfexport.rewrites.examples import Built, Match, NoMatch
from hfexport.rewrites.kinds.fx import NodeRule
from hfexport.rewrites.rule import RuleMeta

aten = torch.ops.aten


def _bucketize(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target is not aten.bucketize.Tensor or len(node.args) < 2:
        return False
    boundaries = node.args[1].meta.get("val") if isinstance(node.args[1], fx.Node) else None
    # The Tensor overload takes 1-D boundaries; a count needs their length to be known here.
    return isinstance(boundaries, torch.Tensor) and boundaries.ndim == 1


def _as_comparison_count(gm: fx.GraphModule, node: fx.Node) -> None:
    """`bucketize(x, b, right=r)` -> the number of boundaries `b[i] <= x` (right) or `b[i] < x` (left): for sorted
    1-D boundaries (bucketize's contract) the bucket index is exactly that count. It is summed one boundary at a
    time (elementwise against `b[i]`, same shape as `x`): comparing against `x.unsqueeze(-1)` made a view with two
    dynamic axes that XNNPACK refused ("reshape only supports 1 dynamic dimension"). NaN compares false everywhere
    but bucketize puts it past the last boundary, so NaN gives `len(b)`, as bucketize does."""
    x, boundaries = node.args[:2]
    right = bool(node.kwargs.get("right", node.args[3] if len(node.args) > 3 else False))
    out_int32 = bool(node.kwargs.get("out_int32", node.args[2] if len(node.args) > 2 else False))
    dtype = torch.int32 if out_int32 else torch.int64
    compare = aten.ge.Tensor if right else aten.gt.Tensor  # x >= b[i] is b[i] <= x
    graph = gm.graph
    x_val, b_val = x.meta["val"], boundaries.meta["val"]
    count_val = x_val.new_zeros(x_val.shape, dtype=dtype)

    def call(target: Any, args: tuple, kwargs: dict | None, val: Any) -> fx.Node:
        new = graph.call_function(target, args, kwargs or {})
        new.meta["val"] = val
        return new

    with graph.inserting_before(node):
        count = call(aten.full_like.default, (x, 0), {"dtype": dtype}, count_val)
        for i in range(int(b_val.shape[0])):
            edge = call(aten.select.int, (boundaries, 0, i), None, b_val.select(0, i))
            above = call(compare, (x, edge), None, compare(x_val, edge.meta["val"]))
            step = call(aten._to_copy.default, (above,), {"dtype": dtype}, count_val)
            count = call(aten.add.Tensor, (count, step), None, count_val)
        nan = call(aten.isnan.default, (x,), None, x_val.isnan())
        past = call(aten.full_like.default, (x, int(b_val.shape[0])), {"dtype": dtype}, count_val)
        result = graph.call_function(aten.where.self, (nan, past, count))
    result.meta = dict(node.meta)
    node.replace_all_uses_with(result)
    graph.erase_node(node)


class _Buckets(torch.nn.Module):
    """SmolVLM/Idefics3's patch positions: fractional coordinates bucketed into `side` boundaries."""

    def __init__(self, side: int = 4, right: bool = True, out_int32: bool = False) -> None:
        super().__init__()
        self.right, self.out_int32 = right, out_int32
        self.register_buffer("boundaries", torch.arange(1 / side, 1.0, 1 / side))

    def forward(self, coords: torch.Tensor) -> torch.Tensor:
        return torch.bucketize(coords, self.boundaries, right=self.right, out_int32=self.out_int32) * 3


class _ArithmeticBuckets(torch.nn.Module):
    """Equal-width buckets computed without bucketize: nothing for the rule to replace."""

    def forward(self, coords: torch.Tensor) -> torch.Tensor:
        return (coords * 4).floor().clamp(0, 3).to(torch.int64) * 3


def _coords(rows: int, cols: int, seed: int = 0) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    coords = torch.rand(rows, cols, generator=generator) * 1.2 - 0.1
    # Values on the boundaries (where right= decides), below and above them, and NaN.
    coords[0, :4] = torch.tensor([0.25, 0.5, 0.75, 0.0])[: min(4, cols)]
    coords[-1, 0] = float("nan")
    return {"coords": coords}


def _built(right: bool = True, out_int32: bool = False) -> Built:
    return _Buckets(right=right, out_int32=out_int32), _coords(3, 6)


bucketize_as_comparison_count = NodeRule(
    RuleMeta(
        id="executorch/bucketize-as-comparison-count",
        why="SmolVLM's vision embeddings (Idefics3's too) bucket the patch coordinates with torch.bucketize; "
        "aten.bucketize.Tensor is not core ATen: to_edge failed with 'Operator torch._ops.aten.bucketize.Tensor "
        "is not in Core ATen opset' (smolvlm, ExecuTorch sweep of 2026-12-02). For sorted 1-D boundaries the "
        "bucket index is the count of boundaries below x (<= for right=True, < otherwise), NaN past the last",
        upstream="executorch==1.4.1 exir/verification/verifier.py (core ATen check) and kernels/portable/"
        "functions.yaml (no bucketize); transformers==5.24.0 modeling_smolvlm.py SmolVLMVisionEmbeddings.forward",
        backends=("executorch",),
        models=("smolvlm",),
        examples=(
            Match(
                lambda: _built(),
                "right=True over 3x6 coordinates (boundary values, NaN), then 5x9",
                other_inputs=lambda: _coords(5, 9, seed=1),
            ),
            Match(
                lambda: _built(right=False, out_int32=True),
                "right=False, int32 indices, then 2x7",
                other_inputs=lambda: _coords(2, 7, seed=2),
            ),
            NoMatch(
                lambda: (_ArithmeticBuckets(), {"coords": torch.rand(3, 6)}),
                "the same buckets by arithmetic (floor of coords * side)",
                reason="no aten.bucketize.Tensor call in the program",
            ),
        ),
    ),
    predicate=_bucketize,
    rewrite=_as_comparison_count,
)
