"""Rule kind of the ExecuTorch lowering (stage `executorch`): fixes of the ATen program before `to_edge`.

- `ExecutorchNodeRule`: a node predicate plus a rewrite of that one node of the captured program's graph,
  run before `to_edge_transform_and_lower`, for ops that the edge dialect, XNNPACK or the portable kernels
  cannot take as they are. One rewritten node is one hit.
- `ExecutorchVerifierExceptionRule`: call targets that ExecuTorch lowers and runs but whose edge-dialect
  verifier wrongly refuses them; where the program calls one, `to_edge` gets it in
  `EdgeCompileConfig(_core_aten_ops_exception_list=...)` (executorch's own knob for this), and the graph is
  left as it is. One call is one hit.
- `ExecutorchEdgePassRule`: where `count(program)` finds its case in the ATen program, graph passes for the
  edge program (`to_edge_transform_and_lower(transform_passes=...)`, before partitioning) that the lowering
  applies; the ATen graph is left as it is. What `count` counts is one hit each.

Building the registry never imports executorch; examples are checked by `hfexport.testing.harness`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import fx

from hfexport.rewrites.kinds.fx import fill_missing_values
from hfexport.rewrites.rule import Rule


@dataclass
class ExecutorchNodeRule(Rule):
    """Rewrite each node of the program graph for which `predicate(node)` holds with `rewrite(gm, node)`."""

    predicate: Callable[[fx.Node], bool] | None = None
    rewrite: Callable[[fx.GraphModule, fx.Node], None] | None = None
    stage: str = field(init=False, default="executorch")


def apply_executorch_rule(rule: ExecutorchNodeRule, program: torch.export.ExportedProgram) -> int:
    """Apply one rule to `program`'s graph in place; return how many nodes it rewrote."""
    gm = program.graph_module
    fill_missing_values(gm)
    hits = 0
    for node in list(gm.graph.nodes):
        if node.graph is gm.graph and rule.predicate(node):
            rule.rewrite(gm, node)
            hits += 1
    if hits:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return hits


@dataclass
class ExecutorchVerifierExceptionRule(Rule):
    """Let `to_edge`'s verifier accept calls of `targets` (the graph is not changed)."""

    targets: tuple[Any, ...] = ()
    stage: str = field(init=False, default="executorch")


# Where the lowering finds the targets the fired exception rules collected (the program's own graph module).
_EXCEPTIONS_KEY = "hfexport_edge_verifier_exceptions"


def _graph_modules(program: torch.export.ExportedProgram) -> list[fx.GraphModule]:
    return [m for m in program.graph_module.modules() if isinstance(m, fx.GraphModule)]


def apply_verifier_exception_rule(rule: ExecutorchVerifierExceptionRule, program: torch.export.ExportedProgram) -> int:
    """Count `program`'s calls of `rule.targets`; record the targets called for `edge_compile_config`."""
    called = [
        node.target
        for gm in _graph_modules(program)
        for node in gm.graph.nodes
        if node.op == "call_function" and node.target in rule.targets
    ]
    if called:
        exceptions = program.graph_module.meta.setdefault(_EXCEPTIONS_KEY, [])
        exceptions.extend(t for t in dict.fromkeys(called) if t not in exceptions)
    return len(called)


def edge_compile_config(program: torch.export.ExportedProgram, config: Any = None) -> Any:
    """`config` (an `EdgeCompileConfig`, default the default one) plus the verifier exceptions that fired on
    `program`; `config` itself when none did."""
    from executorch.exir import EdgeCompileConfig

    exceptions = program.graph_module.meta.get(_EXCEPTIONS_KEY)
    if not exceptions:
        return config
    config = config if config is not None else EdgeCompileConfig()
    known = list(config._core_aten_ops_exception_list)
    return dataclasses.replace(config, _core_aten_ops_exception_list=known + [t for t in exceptions if t not in known])


@dataclass
class ExecutorchEdgePassRule(Rule):
    """Where `count(program)` > 0: `edge_passes()` run on the edge program before partitioning."""

    count: Callable[[torch.export.ExportedProgram], int] | None = None
    edge_passes: Callable[[], list[Any]] | None = None
    stage: str = field(init=False, default="executorch")


# Where the lowering finds the edge passes the fired edge-pass rules ask for: [passes factory] in rule order.
_EDGE_PASSES_KEY = "hfexport_edge_passes"


def apply_edge_pass_rule(rule: ExecutorchEdgePassRule, program: torch.export.ExportedProgram) -> int:
    """Count `rule`'s case in `program`; where it is found, record the rule's passes."""
    hits = rule.count(program)
    if hits:
        program.graph_module.meta.setdefault(_EDGE_PASSES_KEY, []).append(rule.edge_passes)
    return hits


def bypass_nodes(gm: fx.GraphModule, value_of: Callable[[fx.Node], fx.Node | None]) -> Any:
    """An edge pass: every node for which `value_of(node)` names another node of the same values is replaced by
    that node in its users and erased. Returns a `PassResult`."""
    from torch.fx.passes.infra.pass_base import PassResult

    changed = False
    for node in list(gm.graph.nodes):
        same = value_of(node)
        if same is not None:
            node.replace_all_uses_with(same)
            gm.graph.erase_node(node)
            changed = True
    if changed:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, changed)


def edge_transform_passes(program: torch.export.ExportedProgram) -> list[Any]:
    """The edge-program passes the fired edge-pass rules recorded on `program`, in rule order."""
    return [p for factory in program.graph_module.meta.get(_EDGE_PASSES_KEY, []) if factory for p in factory()]


def apply(rule: Rule, target: Any) -> int:
    """The engine's applier of stage `executorch`."""
    if isinstance(rule, ExecutorchVerifierExceptionRule):
        return apply_verifier_exception_rule(rule, target)
    if isinstance(rule, ExecutorchEdgePassRule):
        return apply_edge_pass_rule(rule, target)
    assert isinstance(rule, ExecutorchNodeRule)
    return apply_executorch_rule(rule, target)
