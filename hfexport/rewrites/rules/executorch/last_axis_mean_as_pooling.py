"""A mean over the last axis (RMSNorm's) as XNNPACK's global average pooling, so that it stays in the delegate."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_symbols

from hfexport.rewrites.examples import Built, Match, NoMatch
from hfexport.rewrites.kinds.fx import NodeRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.executorch._view_sizes import inferred_sizes

_MEAN = torch.ops.aten.mean.dim
_VIEW = torch.ops.aten.view.default


def _last_axis_mean(node: fx.Node) -> bool:
    """`mean(x, [-1])` (keepdim or not, no dtype) of a float32 `x` of rank 2 or more whose last axis is static and
    which has one dynamic axis at most: the views around the pooling then have static sizes or one -1."""
    if node.op != "call_function" or node.target is not _MEAN or node.kwargs.get("dtype") is not None:
        return False
    source = getattr(node.args[0], "meta", {}).get("val")
    value = node.meta.get("val")
    if not isinstance(source, torch.Tensor) or not isinstance(value, torch.Tensor):
        return False
    if source.dtype != torch.float32 or source.ndim < 2 or free_symbols(source.shape[-1]):
        return False
    dims = node.args[1] if len(node.args) > 1 else None
    if not isinstance(dims, (list, tuple)) or len(dims) != 1 or dims[0] % source.ndim != source.ndim - 1:
        return False
    return inferred_sizes(source) is not None and inferred_sizes(value) is not None


def _as_pooling(gm: fx.GraphModule, node: fx.Node) -> None:
    """`mean(x, [-1], keepdim)` -> `view(mean(view(x, [-1, 1, n, 1]), [2, 3], keepdim=True), out_sizes)`.

    Every row of x becomes one image of one channel, n pixels high and one wide: XNNPACK takes a 4-D mean over
    the two inner axes (its global average pooling), and the same n values are averaged for each row. The views
    have static sizes or one -1, which XNNPACK's reshape infers (the rule's predicate makes sure)."""
    source = node.args[0]
    source_value = source.meta["val"]
    columns = int(source_value.shape[-1])
    with gm.graph.inserting_before(node):
        images = gm.graph.call_function(_VIEW, (source, [-1, 1, columns, 1]))
        images.meta["val"] = source_value.reshape(-1, 1, columns, 1)
        pooled = gm.graph.call_function(_MEAN, (images, [2, 3], True))
        pooled.meta["val"] = images.meta["val"].mean([2, 3], keepdim=True)
        result = gm.graph.call_function(_VIEW, (pooled, inferred_sizes(node.meta["val"])))
    result.meta = dict(node.meta)
    node.replace_all_uses_with(result)
    gm.graph.erase_node(node)


class _RmsNorm(torch.nn.Module):
    """A projection and an RMSNorm as transformers writes it (`pow(2).mean(-1, keepdim=True)`), or a mean over
    `dim` without keepdim added back."""

    def __init__(self, dim: int = -1, keepdim: bool = True) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(24, 24)
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, 24))
        self.dim = dim
        self.keepdim = keepdim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.proj(x)
        if not self.keepdim:
            return hidden * 2.0 + hidden.mean(self.dim).unsqueeze(-1)
        variance = hidden.pow(2).mean(self.dim, keepdim=True)
        return self.weight * (hidden * torch.rsqrt(variance + 1e-6))


def _states(batch: int, length: int, seed: int = 0) -> dict[str, Any]:
    return {"x": torch.randn(batch, length, 24, generator=torch.Generator().manual_seed(seed))}


def _built(batch: int = 1, length: int = 6, dim: int = -1, keepdim: bool = True) -> Built:
    torch.manual_seed(0)
    return _RmsNorm(dim, keepdim).eval(), _states(batch, length)


last_axis_mean_as_pooling = NodeRule(
    RuleMeta(
        id="executorch/last-axis-mean-as-pooling",
        why="XNNPACK takes `mean.dim` only on a 4-D tensor over its two inner axes (its global average pooling), so "
        "RMSNorm's `pow(2).mean(-1, keepdim=True)` ran in the portable kernel and cut each layer's partition twice "
        "(docs/executorch.md, 'Lowering time'). Each row as a 1-channel image n pixels high, pooled, viewed back: "
        "the same mean, inside the delegate. Needs static sizes or one dynamic axis (batch 1, or a static decode "
        "graph), where the views around it are XNNPACK's too. SmolLM2-shaped Llama, multi-token decode graph at 4 "
        "layers, batch 1, with executorch/one-dynamic-axis-view-inferred: 39 XNNPACK partitions without this rule, "
        "31 with it (9 means), tokens equal"
        "; measured by tools/ab_rules.py (the executorch-static-decode form, 4 layers at "
        "SmolLM2-135M's width, batch 1, 128-token prompt, 64 new tokens, 2-core AVX2 EPYC): decode 0.95x (4 "
        "rounds: 169.5 against 177.4 tok/s) and 0.99x (8 rounds: 164.8 against 167.2): no decode gain on this CPU"
        " (XNNPACK's pooling over a 1-channel image runs no faster than the portable mean); what it changes is "
        "the partition count above",
        upstream="executorch==1.4.1 backends/xnnpack/partition/config/generic_node_configs.py MeanDimConfig (4-D "
        "over dims 2 and 3, keepdim only)",
        backends=("executorch",),
        kind="optimization",
        examples=(
            Match(
                lambda: _built(),
                "RMSNorm's pow(2).mean(-1, keepdim=True) over batch 1 and a dynamic length, then another length",
                other_inputs=lambda: _states(1, 11, seed=1),
            ),
            Match(
                lambda: _built(keepdim=False),
                "mean(-1) without keepdim over batch 1 and a dynamic length, then a length of 1",
                other_inputs=lambda: _states(1, 1, seed=2),
            ),
            # Batch and length both dynamic (the views would have two -1): left alone, in
            # tests/rewrites/test_executorch_rules.py (a NoMatch is exported static).
            NoMatch(lambda: _built(dim=-2), "a mean over another axis than the last"),
        ),
    ),
    predicate=_last_axis_mean,
    rewrite=_as_pooling,
)
