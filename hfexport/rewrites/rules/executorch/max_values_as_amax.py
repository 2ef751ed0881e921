"""`max(x, dim).values` of a 4-D tensor that XNNPACK's partitioner takes and its serializer then refuses."""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from hfexport.rewrites.examples import Built, Match, NoMatch
from hfexport.rewrites.kinds.fx import NodeRule
from hfexport.rewrites.rule import RuleMeta

_MAX_DIM = torch.ops.aten.max.dim
_AMAX = torch.ops.aten.amax.default


def _values_only(node: fx.Node) -> bool:
    """`node` (a `max.dim`) is read through `getitem`s, and the indices (`getitem 1`) by nobody (the capture keeps
    an unused `getitem 1`)."""
    users = list(node.users)
    return (
        all(user.op == "call_function" and user.target is operator.getitem for user in users)
        and any(user.args[1] == 0 for user in users)
        and all(user.args[1] == 0 or not user.users for user in users)
    )


def _xnnpack_4d_max(node: fx.Node) -> bool:
    """A values-only `max.dim` of a 4-D tensor, which XNNPACK's partitioner takes.

    Its partitioner (MaxDimConfig) takes every values-only `max.dim` of a 4-D float tensor; its
    RemoveGetItemPass turns it into `amax`, whose visitor (a max pooling in NHWC) only writes `dim` 2 or 3
    exactly as the graph spells it (not -1 or -2) with keepdim=True and fails the whole lowering otherwise;
    and the form it does write computes wrong values (softmax(x - max(x, dim=3)) off by 0.999 on a
    [2, 2, 6, 7] input) and fails to load with a dynamic size (std::bad_alloc).
    """
    if node.op != "call_function" or node.target is not _MAX_DIM or not _values_only(node):
        return False
    source = node.args[0]
    value = source.meta.get("val") if isinstance(source, fx.Node) else None
    return isinstance(value, torch.Tensor) and value.ndim == 4


def _max_values_as_amax(gm: fx.GraphModule, node: fx.Node) -> None:
    """`max(x, dim, keepdim)[0]` -> `amax(x, [dim], keepdim)`: the same values (NaN propagates in both); XNNPACK's
    partitioner takes no `amax`, so it runs as the portable kernel, at any rank and dynamic size."""
    dim = node.args[1] if len(node.args) > 1 else node.kwargs["dim"]
    keepdim = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
    with gm.graph.inserting_before(node):
        amax = gm.graph.call_function(_AMAX, (node.args[0], [dim], keepdim))
    amax.meta = {k: v for k, v in node.meta.items() if k != "val"}
    amax.meta["val"] = node.meta["val"][0]
    for user in list(node.users):
        if user.args[1] == 0:
            user.replace_all_uses_with(amax)
        gm.graph.erase_node(user)  # the values, now from amax; or the unused indices
    gm.graph.erase_node(node)


class _SinkSoftmax(torch.nn.Module):
    """gpt_oss's attention with sinks: the logits minus their row maximum (`max(dim=-1).values`), softmax."""

    def __init__(self, dim: int = -1, keepdim: bool = True, indices: bool = False) -> None:
        super().__init__()
        self.dim = dim
        self.keepdim = keepdim
        self.indices = indices

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        result = logits.max(dim=self.dim, keepdim=self.keepdim)
        peak = result.values if self.keepdim else result.values.unsqueeze(self.dim)
        probs = torch.softmax(logits - peak, dim=-1)
        return probs + result.indices.to(probs.dtype) if self.indices else probs


def _logits(batch: int, length: int, seed: int = 0) -> dict[str, Any]:
    return {"logits": torch.randn(batch, 2, length, length + 1, generator=torch.Generator().manual_seed(seed)) * 4}


def _built(dim: int = -1, keepdim: bool = True, indices: bool = False) -> Built:
    return _SinkSoftmax(dim, keepdim, indices), _logits(2, 6)


def _built_3d() -> Built:
    """The same softmax over one head folded away: a 3-D `max.dim`, which XNNPACK's partitioner leaves."""
    return _SinkSoftmax(), {"logits": _logits(2, 6)["logits"][:, 0]}


max_values_as_amax = NodeRule(
    RuleMeta(
        id="executorch/max-values-as-amax",
        why="XNNPACK's partitioner takes the values-only `max(x, dim)` of a 4-D tensor without checking `dim`, and "
        "its serializer then fails the lowering with 'amax.default only supports dim == 2 or dim == 3' for "
        "gpt_oss's attention sinks (`logits.max(dim=-1, keepdim=True).values`: dim -1, not 3) or 'only supports "
        "keep_dim == True'; and the one form it writes, dim 2 or 3 with keepdim, gives wrong values (off by 0.999 "
        "after a softmax) and a program that fails to load with a dynamic size (std::bad_alloc). `amax` computes "
        "the same values and runs as the portable kernel",
        upstream="executorch==1.4.1 backends/xnnpack/partition/config/node_configs.py MaxDimConfig checks rank and "
        "dtype only; backends/xnnpack/operators/op_max_dim.py MaxDim.define_node compares the raw dim with 2 and 3 (no "
        "issue filed)",
        backends=("executorch",),
        models=("gpt_oss",),
        examples=(
            Match(
                lambda: _built(),
                "logits.max(dim=-1, keepdim=True).values over dynamic batch and length, then another batch and length",
                other_inputs=lambda: _logits(3, 11, seed=1),
            ),
            Match(
                lambda: _built(dim=2, keepdim=False),
                "max(dim=2).values without keepdim, then another batch and length",
                other_inputs=lambda: _logits(1, 9, seed=2),
            ),
            NoMatch(lambda: _built(indices=True), "max(dim=-1) whose indices are used too (XNNPACK does not take it)"),
            Match(
                lambda: _built(dim=3),
                "max(dim=3, keepdim=True).values, the form XNNPACK writes (wrongly); then another batch and length",
                other_inputs=lambda: _logits(3, 5, seed=3),
            ),
            NoMatch(_built_3d, "a 3-D max(dim=-1).values (XNNPACK's partitioner takes only 4-D)"),
        ),
    ),
    predicate=_xnnpack_4d_max,
    rewrite=_max_values_as_amax,
)
