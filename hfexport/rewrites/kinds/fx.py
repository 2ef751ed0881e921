"""FX rule kinds: rewrites of the ATen-level graph of an `ExportedProgram`.

Three forms, after `torch.fx.subgraph_rewriter` and onnxscript's rewriter:

- `FxNodeRule`: a node predicate plus a rewrite of that one node (single-node fixes).
- `FxPatternRule`: `pattern` and `replacement` written as plain torch functions, traced to ATen graphs
  with `make_fx` on `pattern_args()` (a plain Python callable does not match an exported graph), with
  an optional `check(match, graph_module)` that returns why a match must be left alone.
- `FxGraphRule`: a transform of the whole graph, all or nothing (e.g. complex values lowered to real pairs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from hfexport.rewrites.declines import note_declined
from hfexport.rewrites.rule import Rule


@dataclass
class FxNodeRule(Rule):
    predicate: Callable[[fx.Node], bool] | None = None
    rewrite: Callable[[fx.GraphModule, fx.Node], None] | None = None
    stage: str = field(init=False, default="fx")


@dataclass
class FxPatternRule(Rule):
    pattern: Callable[..., Any] | None = None
    replacement: Callable[..., Any] | None = None
    pattern_args: Callable[[], tuple[Any, ...]] | None = None
    check: Callable[[Any, fx.GraphModule], str | None] | None = None
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


FxRule = FxNodeRule | FxPatternRule | FxGraphRule


def _aten_graph(fn: Callable[..., Any], args: tuple[Any, ...]) -> fx.GraphModule:
    from torch.fx.experimental.proxy_tensor import make_fx

    return make_fx(fn, pre_dispatch=False)(*args)


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
        from torch.fx import subgraph_rewriter

        args = rule.pattern_args()
        check = rule.check

        def keep(match: Any, original_graph: fx.Graph, pattern_graph: fx.Graph) -> bool:
            if check is None:
                return True
            reason = check(match, gm)
            if reason is not None:
                # The check says why this match is left alone: kept for `audit --explain`.
                note_declined(rule.id, reason)
            return reason is None

        replaced = subgraph_rewriter.replace_pattern_with_filters(
            gm, _aten_graph(rule.pattern, args), _aten_graph(rule.replacement, args), match_filters=[keep]
        )
        hits = len(replaced)
    if hits:
        gm.graph.lint()
        gm.recompile()
    return hits


def graph_code(gm: fx.GraphModule) -> str:
    """A stable text form of a graph, to prove that a rule changed nothing."""
    return gm.code


def exported_graph_module(program: torch.export.ExportedProgram) -> fx.GraphModule:
    return program.graph_module
