"""Graph rule kinds: rewrites of the ATen-level graph of an `ExportedProgram`.

- `NodeRule`: a node predicate plus a rewrite of that one node. One kind for every stage that edits the captured
  program: `fx` (the graph every backend gets), `executorch` (before `to_edge`) and `openvino` (before
  `convert_model`); the rule's id names its stage, so only that backend's lowering runs it. One rewritten node is
  one hit. The predicate may return `Declined(reason)` for a node it matched but refuses: the reason is counted
  among the rule's declines (the audit shows it).
- `FxGraphRule`: a transform of the whole graph, all or nothing (e.g. complex values lowered to real pairs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import fx

from hfexport.rewrites.declines import Declined, clean_reason
from hfexport.rewrites.rule import Applied, Rule

# A node predicate's answer: rewrite it (true), leave it (false), or leave it and say why (`Declined`).
Verdict = bool | Declined | None


@dataclass
class NodeRule(Rule):
    """Rewrite each node of the program graph for which `predicate(node)` holds with `rewrite(gm, node)`."""

    predicate: Callable[[fx.Node], Verdict] | None = None
    rewrite: Callable[[fx.GraphModule, fx.Node], None] | None = None
    stages: ClassVar[tuple[str, ...]] = ("fx", "executorch", "openvino")
    phase: str = field(init=False, default="program")


@dataclass
class FxGraphRule(Rule):
    """A whole-graph transform, for rewrites that must change a connected set of nodes together (e.g. every
    complex-valued node at once): `transform(gm)` rewrites in place and returns the sites it changed, or
    0 without touching the graph when it cannot rewrite all of them."""

    transform: Callable[[fx.GraphModule], int] | None = None
    # A transform that needs the whole `ExportedProgram` (its lifted constants and signature), not only the graph.
    program_transform: Callable[[torch.export.ExportedProgram], int] | None = None
    stages: ClassVar[tuple[str, ...]] = ("fx",)
    phase: str = field(init=False, default="program")


# The stages whose node rules see every node's value and leave no dead node behind. ExecuTorch's rules run after
# the `fx` stage's graph rules, whose nodes may have no value yet (fx/complex-to-real's): each rule first fills them
# in, so its predicate reads every node's shape; and what a rewrite leaves unused is dropped before the next rule.
# The `fx` and `openvino` stages run their node rules on the graph as it is: filling values there would let their
# predicates match nodes they never saw (a change of what fires, to be measured before it is made).
_SETTLED_STAGES = frozenset({"executorch"})


def fill_missing_values(gm: fx.GraphModule) -> int:
    """Give each ATen call without a `val` (nodes an earlier graph rule added, e.g. fx/complex-to-real) its fake
    value, computed from its inputs' in the program's fake mode, so node predicates can read shapes; return
    how many were filled. A node whose inputs have no value either is left as it is."""
    from torch._guards import detect_fake_mode
    from torch.utils import _pytree as pytree

    fake_mode = detect_fake_mode([n.meta["val"] for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)])
    if fake_mode is None:
        return 0
    filled = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or "val" in node.meta or not isinstance(node.target, torch._ops.OpOverload):
            continue
        inputs = [a for a in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(a, fx.Node)]
        if any("val" not in a.meta for a in inputs):
            continue
        args, kwargs = pytree.tree_map_only(fx.Node, lambda a: a.meta["val"], (node.args, node.kwargs))
        try:
            with fake_mode:
                node.meta["val"] = node.target(*args, **kwargs)
        except Exception:  # metadata only: a node that cannot be evaluated keeps none
            continue
        filled += 1
    return filled


def _graph_module(target: fx.GraphModule | torch.export.ExportedProgram) -> fx.GraphModule:
    return target.graph_module if isinstance(target, torch.export.ExportedProgram) else target


def apply_node_rule(rule: Rule, target: Any, hit: Callable[[], None] | None = None) -> Applied:
    """Apply a `NodeRule` to a graph (or an `ExportedProgram`'s graph) in place: rewrite every node its predicate
    accepts, and count the reasons of the nodes it declines."""
    assert isinstance(rule, NodeRule)
    gm = _graph_module(target)
    settled = rule.stage in _SETTLED_STAGES
    if settled:
        fill_missing_values(gm)
    applied = Applied()
    for node in list(gm.graph.nodes):
        if node.graph is not gm.graph:
            continue  # erased by an earlier rewrite of this pass
        verdict = rule.predicate(node)
        if isinstance(verdict, Declined):
            applied.declined[clean_reason(verdict.reason)] += 1
        elif verdict:
            rule.rewrite(gm, node)
            applied.hits += 1
    if applied.hits:
        if settled:
            gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return applied


def apply_graph_rule(rule: Rule, target: Any, hit: Callable[[], None] | None = None) -> Applied:
    """Apply an `FxGraphRule` to a graph (or an `ExportedProgram`) in place."""
    assert isinstance(rule, FxGraphRule)
    if rule.program_transform is not None:
        if not isinstance(target, torch.export.ExportedProgram):
            return Applied()  # a bare graph has no lifted constants to fold
        return Applied(rule.program_transform(target))
    gm = _graph_module(target)
    hits = rule.transform(gm)
    if hits:
        gm.graph.lint()
        gm.recompile()
    return Applied(hits)
