"""Rule `executorch/is-all-true-as-any`: transformers' tensor checks through the ExecuTorch edge dialect."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.fx import NodeRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules._hunyuan_vl import hunyuan_vl_merge

aten = torch.ops.aten


def _is_all_true(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is aten._is_all_true.default


def _as_not_any_not(gm: fx.GraphModule, node: fx.Node) -> None:
    """`_is_all_true(x)` -> `logical_not(any(logical_not(x)))`: the same 0-d bool for every bool tensor (True for an
    empty one: any() of nothing is False), with ops the portable kernels have."""
    (x,) = node.args
    graph = gm.graph
    with graph.inserting_before(node):
        inverted = graph.call_function(aten.logical_not.default, (x,))
        some = graph.call_function(aten.any.default, (inverted,))
        result = graph.call_function(aten.logical_not.default, (some,))
    for new, fn, arg in ((inverted, aten.logical_not.default, x), (some, aten.any.default, inverted)):
        new.meta["val"] = fn(arg.meta["val"]) if "val" in arg.meta else None
    result.meta = dict(node.meta)
    node.replace_all_uses_with(result)
    graph.erase_node(node)


def _inputs(tokens: int, seed: int = 0) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, 20, (1, tokens + 3), generator=generator)
    ids[0, 1 : tokens + 1] = 5
    return {"ids": ids, "features": torch.randn(tokens, 4, generator=generator)}


class _SizeCheck(torch.nn.Module):
    """The same check on sizes only (Python ints): no tensor condition, no `_is_all_true`."""

    def forward(self, ids: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        from transformers.utils.import_utils import torch_compilable_check

        torch_compilable_check(features.shape[0] <= ids.shape[1], "more features than tokens")
        return features * 2


is_all_true_as_any = NodeRule(
    RuleMeta(
        id="executorch/is-all-true-as-any",
        why="transformers' torch_compilable_check on a tensor condition (the placeholder checks of 129 modeling "
        "files, e.g. HunYuan-VL's image tokens against its features) traces to aten._is_all_true, which is not "
        "core ATen: to_edge fails with 'Operator aten._is_all_true.default is not in Core ATen opset', and the "
        "portable kernels have no all(). It becomes logical_not(any(logical_not(x))), the same value",
        upstream="executorch==1.4.1 kernels/portable/functions.yaml (any.all_out, no all); torch==2.13.0 "
        "torch/_refs/__init__.py _check_tensor_all_with (traced as aten._is_all_true)",
        backends=("executorch",),
        models=("hunyuan_vl", "llava", "qwen2_vl"),
        examples=(
            # The placeholder check only traces with HunYuan-VL's patch (transformers' own code branches on it).
            Match(
                hunyuan_vl_merge,
                "HunYuan-VL's merge: two rows with three image tokens each",
                needs=("patch/hunyuan-vl-placeholder-check",),
            ),
            NoMatch(lambda: (_SizeCheck(), _inputs(3)), "a check on sizes only (a symbolic condition, no tensor)"),
        ),
    ),
    predicate=_is_all_true,
    rewrite=_as_not_any_not,
)
