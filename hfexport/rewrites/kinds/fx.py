"""FX rule kinds: rewrites of the ATen-level graph of an `ExportedProgram`.

Two forms (a subgraph-pattern kind was removed when no rule used it; ONNX-level patterns are onnxscript
rewriter rules, see `kinds/onnx.py`):

- `FxNodeRule`: a node predicate plus a rewrite of that one node (single-node fixes).
- `FxGraphRule`: a transform of the whole graph, all or nothing (e.g. complex values lowered to real pairs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import fx

from hfexport.rewrites.rule import Rule


@dataclass
class FxNodeRule(Rule):
    predicate: Callable[[fx.Node], bool] | None = None
    rewrite: Callable[[fx.GraphModule, fx.Node], None] | None = None
    stage: str = field(init=False, default="fx")


@dataclass
class FxGraphRule(Rule):
    """A whole-graph transform, for rewrites that must change a connected set of nodes together (e.g. every
    complex-valued node at once): `transform(gm)` rewrites in place and returns the sites it changed, or
    0 without touching the graph when it cannot rewrite all of them."""

    transform: Callable[[fx.GraphModule], int] | None = None
    # A transform that needs the whole `ExportedProgram` (its lifted constants and signature), not only the graph.
    program_transform: Callable[[torch.export.ExportedProgram], int] | None = None
    stage: str = field(init=False, default="fx")


FxRule = FxNodeRule | FxGraphRule


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


def apply_fx_rule(rule: FxRule, target: fx.GraphModule | torch.export.ExportedProgram) -> int:
    """Apply one rule to a graph (or an `ExportedProgram`'s graph) in place; return how many sites it rewrote."""
    if isinstance(rule, FxGraphRule) and rule.program_transform is not None:
        if not isinstance(target, torch.export.ExportedProgram):
            return 0  # a bare graph has no lifted constants to fold
        return rule.program_transform(target)
    gm = target.graph_module if isinstance(target, torch.export.ExportedProgram) else target
    if isinstance(rule, FxGraphRule):
        hits = rule.transform(gm)
    elif isinstance(rule, FxNodeRule):
        hits = 0
        for node in list(gm.graph.nodes):
            if node.graph is gm.graph and rule.predicate(node):
                rule.rewrite(gm, node)
                hits += 1
    else:
        raise TypeError(f"not an fx rule: {rule!r}")
    if hits:
        gm.graph.lint()
        gm.recompile()
    return hits


def graph_code(gm: fx.GraphModule) -> str:
    """A stable text form of a graph, to prove that a rule changed nothing."""
    return gm.code


def exported_graph_module(program: torch.export.ExportedProgram) -> fx.GraphModule:
    return program.graph_module
