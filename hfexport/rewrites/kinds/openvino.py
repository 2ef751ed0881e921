"""Rule kinds of the OpenVINO lowering (stage `openvino`), its applier and its example checker.

The stage runs twice per export, on two targets:

- before conversion, on the captured `ExportedProgram`: `OpenVINOFxNodeRule` / `OpenVINOFxPatternRule`, the
  FX rule forms of `graph.py` (single node, or `pattern` / `replacement`) for graph shapes that
  `openvino.convert_model` mistranslates or refuses. They are FX rules that run only in this lowering, so
  the program other backends see is never touched.
- after conversion, on the `openvino.Model`: `OpenVINOModelRule`, a function that fixes the converted model
  in place and returns how many sites it changed.

Examples: a `Match` module is exported, the rule applied, the result converted and compiled on CPU with the
f32 inference-precision hint, and OpenVINO must match eager (also on `other_inputs()` when given, with every
axis dynamic). A `NoMatch` must fire zero times and leave the graph (or the model) unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from hfexport.rewrites import engine, examples
from hfexport.rewrites.examples import Example, ExampleFailure, Match, assert_same_outputs
from hfexport.rewrites.kinds.fx import FxNodeRule, FxPatternRule, apply_fx_rule
from hfexport.rewrites.rule import Rule

# Compute in f32 when validating: the CPU plugin's default hint is bf16/f16 on CPUs that have it.
F32_HINT = {"INFERENCE_PRECISION_HINT": "f32"}


@dataclass
class OpenVINOFxNodeRule(FxNodeRule):
    """A single-node FX fix applied to the program just before `openvino.convert_model`."""

    stage: str = field(init=False, default="openvino")


@dataclass
class OpenVINOFxPatternRule(FxPatternRule):
    """A pattern/replacement FX fix applied to the program just before `openvino.convert_model`."""

    stage: str = field(init=False, default="openvino")


@dataclass
class OpenVINOModelRule(Rule):
    """A fix of the converted `openvino.Model`: `transform(model)` edits it in place, returns the sites changed."""

    transform: Callable[[Any], int] | None = None
    stage: str = field(init=False, default="openvino")


PROGRAM_RULES = (OpenVINOFxNodeRule, OpenVINOFxPatternRule)


def apply_openvino_rule(rule: Rule, target: Any) -> int:
    """Apply one rule to its target (an `ExportedProgram` or a `GraphModule`, or an `openvino.Model`)."""
    if isinstance(rule, PROGRAM_RULES):
        gm = target.graph_module if hasattr(target, "graph_module") else target
        if not isinstance(gm, torch.fx.GraphModule):
            return 0
        return apply_fx_rule(rule, gm)
    if isinstance(rule, OpenVINOModelRule):
        if isinstance(target, (torch.export.ExportedProgram, torch.fx.GraphModule)):
            return 0
        return rule.transform(target)
    raise TypeError(f"not an openvino rule: {rule!r}")


engine.register_applier("openvino", apply_openvino_rule)


def rules_of(kinds: tuple[type, ...], registry: engine.RuleRegistry | None = None) -> engine.RuleRegistry:
    """The registered `openvino` rules of the given kinds, in their order (one registry per target)."""
    registry = registry or engine.default_registry()
    selected = engine.RuleRegistry(universe=registry)
    for rule in registry.rules("openvino"):
        if isinstance(rule, kinds):
            selected.register(rule)
    return selected


# -- example checker -------------------------------------------------------------------------------


def _numpy(value: Any) -> Any:
    return value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)


def run_compiled(model: Any, inputs: dict[str, Any]) -> list[torch.Tensor]:
    """Compile `model` on CPU with the f32 hint and run it on the tensor values of `inputs`, in order."""
    import openvino as ov

    compiled = ov.Core().compile_model(model, "CPU", F32_HINT)
    tensors = [_numpy(v) for v in inputs.values() if isinstance(v, torch.Tensor)]
    result = compiled(tensors)
    return [torch.from_numpy(np.array(result[out])) for out in compiled.outputs]


def _check_against_eager(rule: Rule, example: Match, module: torch.nn.Module, ov_model: Any, inputs: Any) -> None:
    from torch.utils import _pytree as pytree

    with torch.no_grad():
        expected = module(**inputs)
    # An int output (a size) is a 0-d int64 output of the OpenVINO model.
    expected = pytree.tree_map_only(int, lambda v: torch.tensor(v, dtype=torch.int64), expected)
    assert_same_outputs(expected, run_compiled(ov_model, inputs), example.atol, example.rtol, rule.id)


def _other_rules(rule: Rule, kinds: tuple[type, ...]) -> list[Rule]:
    """The registered openvino rules of `kinds` but `rule`: the rest of the lowering a Match runs through."""
    return [r for r in rules_of(kinds).rules("openvino") if r.id != rule.id]


def _model_text(model: Any) -> list[tuple[str, str, tuple[str, ...]]]:
    """Ops, their types and their input shapes: enough to prove a model rule left a model alone."""
    return [
        (
            op.get_friendly_name(),
            op.get_type_name(),
            tuple(str(op.input_value(i).get_partial_shape()) for i in range(op.get_input_size())),
        )
        for op in model.get_ordered_ops()
    ]


def _check_openvino(rule: Any, example: Example) -> int:
    import openvino as ov

    from hfexport.frontends.cache_pytree import register_cache_pytrees

    register_cache_pytrees()  # examples may return a transformers cache, as real exports do
    module, inputs = example.build()
    module.eval()
    dynamic = isinstance(example, Match) and example.other_inputs is not None
    with torch.no_grad():
        program = examples._export(module, inputs, dynamic=dynamic)
    # A Match runs through the whole lowering (the other rules too: a size rewritten by one rule may need
    # another to convert or to compute right); the rule under test must fire, and fires first on its target.
    lowering = isinstance(example, Match)
    if isinstance(rule, PROGRAM_RULES):
        before = program.graph_module.code
        hits = apply_openvino_rule(rule, program)
        unchanged = program.graph_module.code == before
        ov_model = None
        if lowering:
            for other in _other_rules(rule, PROGRAM_RULES):
                apply_openvino_rule(other, program)
            ov_model = ov.convert_model(program)
            for other in _other_rules(rule, (OpenVINOModelRule,)):
                apply_openvino_rule(other, ov_model)
    else:
        if lowering:
            for other in _other_rules(rule, PROGRAM_RULES):
                apply_openvino_rule(other, program)
        ov_model = ov.convert_model(program)
        before_ops = _model_text(ov_model)
        hits = apply_openvino_rule(rule, ov_model)
        unchanged = _model_text(ov_model) == before_ops
        if lowering:
            for other in _other_rules(rule, (OpenVINOModelRule,)):
                apply_openvino_rule(other, ov_model)
    if isinstance(example, Match):
        if hits == 0:
            raise ExampleFailure(f"{rule.id}: Match example {example.description!r} did not fire")
        _check_against_eager(rule, example, module, ov_model, inputs)
        if example.other_inputs is not None:
            _check_against_eager(rule, example, module, ov_model, example.other_inputs())
    elif hits or not unchanged:
        raise ExampleFailure(f"{rule.id}: NoMatch example {example.description!r} changed the program")
    return hits


examples.register_checker("openvino", _check_openvino)
