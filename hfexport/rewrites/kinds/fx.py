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
