"""Rule kinds of the ExecuTorch lowering (stage `executorch`) that hand something to `to_edge` instead of editing
the program; the node rewrites of this stage are `NodeRule`s (`kinds/fx.py`).

- `ExecutorchVerifierExceptionRule`: call targets that ExecuTorch lowers and runs but whose edge-dialect
  verifier wrongly refuses them; where the program calls one, its applier hands the targets to the lowering
  (`VerifierExceptions`), which adds them to `EdgeCompileConfig(_core_aten_ops_exception_list=...)` (executorch's
  own knob for this). The graph is left as it is. One call is one hit.
- `ExecutorchEdgePassRule`: where `count(program)` finds its case in the ATen program, graph passes for the
  edge program (`to_edge_transform_and_lower(transform_passes=...)`, before partitioning); its applier hands
  them to the lowering (`EdgePasses`). The ATen graph is left as it is. What `count` counts is one hit each.

The lowering reads what the rules handed over from the stage's result (`engine.apply(...).outputs`):
`edge_compile_config(outputs)` and `edge_transform_passes(outputs)`. Building the registry never imports
executorch; examples are checked by `hfexport.testing.harness`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import fx

from hfexport.rewrites.rule import Applied, Rule


@dataclass
class ExecutorchVerifierExceptionRule(Rule):
    """Let `to_edge`'s verifier accept calls of `targets` (the graph is not changed)."""

    targets: tuple[Any, ...] = ()
    stages: ClassVar[tuple[str, ...]] = ("executorch",)
    phase: str = field(init=False, default="program")


@dataclass(frozen=True)
class VerifierExceptions:
    """What a verifier-exception rule hands to the lowering: the call targets the program has and `to_edge` must let
    through."""

    targets: tuple[Any, ...]


def _graph_modules(program: torch.export.ExportedProgram) -> list[fx.GraphModule]:
    return [m for m in program.graph_module.modules() if isinstance(m, fx.GraphModule)]


def apply_verifier_exception_rule(rule: Rule, program: Any, hit: Callable[[], None] | None = None) -> Applied:
    """Count `program`'s calls of `rule.targets`; hand the targets called to the lowering."""
    assert isinstance(rule, ExecutorchVerifierExceptionRule)
    called = [
        node.target
        for gm in _graph_modules(program)
        for node in gm.graph.nodes
        if node.op == "call_function" and node.target in rule.targets
    ]
    if not called:
        return Applied()
    return Applied(len(called), outputs=(VerifierExceptions(tuple(dict.fromkeys(called))),))


def edge_compile_config(outputs: Iterable[Any], config: Any = None) -> Any:
    """`config` (an `EdgeCompileConfig`, default the default one) plus the verifier exceptions among a stage's
    `outputs`; `config` itself when there are none."""
    exceptions = [t for output in outputs if isinstance(output, VerifierExceptions) for t in output.targets]
    if not exceptions:
        return config
    from executorch.exir import EdgeCompileConfig

    config = config if config is not None else EdgeCompileConfig()
    known = list(config._core_aten_ops_exception_list)
    added = [t for t in dict.fromkeys(exceptions) if t not in known]
    return dataclasses.replace(config, _core_aten_ops_exception_list=known + added)


@dataclass
class ExecutorchEdgePassRule(Rule):
    """Where `count(program)` > 0: `edge_passes()` run on the edge program before partitioning."""

    count: Callable[[torch.export.ExportedProgram], int] | None = None
    edge_passes: Callable[[], list[Any]] | None = None
    stages: ClassVar[tuple[str, ...]] = ("executorch",)
    phase: str = field(init=False, default="program")


@dataclass(frozen=True)
class EdgePasses:
    """What an edge-pass rule hands to the lowering: the factory of its passes for the edge program."""

    factory: Callable[[], list[Any]]


def apply_edge_pass_rule(rule: Rule, program: Any, hit: Callable[[], None] | None = None) -> Applied:
    """Count `rule`'s case in `program`; where it is found, hand the rule's passes to the lowering."""
    assert isinstance(rule, ExecutorchEdgePassRule)
    hits = rule.count(program)
    if not hits:
        return Applied()
    return Applied(hits, outputs=(EdgePasses(rule.edge_passes),))


def edge_transform_passes(outputs: Iterable[Any]) -> list[Any]:
    """The edge-program passes among a stage's `outputs`, in rule order."""
    return [p for output in outputs if isinstance(output, EdgePasses) and output.factory for p in output.factory()]


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
