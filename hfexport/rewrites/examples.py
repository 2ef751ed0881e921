"""Rule examples (`Match`, `NoMatch`) and the code that checks them.

A `Match` builds a small module and inputs on which the rule must fire and keep eager numerics; a
`NoMatch` builds one on which the rule must fire zero times and change nothing. Like LibCST's codemod
tests, the examples live on the rule, and `tests/rewrites/test_examples.py` runs every one of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

Built = tuple[torch.nn.Module, dict[str, Any]]


@dataclass(frozen=True)
class Match:
    """The rule fires on `build()`'s module and the result matches eager within `atol`/`rtol`."""

    build: Callable[[], Built]
    description: str = ""
    atol: float = 1e-5
    rtol: float = 1e-5
    # Export with every tensor axis dynamic, and also check the program on `other_inputs()` (e.g. another
    # sequence length) against eager: the proof for rules whose point is a symbolic shape.
    other_inputs: Callable[[], dict[str, Any]] | None = None
    # ONNX stages: the opset to export the example at (None: the checker's default); for rules whose
    # rewrite depends on the opset.
    opset: int | None = None


@dataclass(frozen=True)
class NoMatch:
    """The rule fires zero times on `build()`'s module and changes nothing."""

    build: Callable[[], Built]
    description: str = ""
    opset: int | None = None


Example = Match | NoMatch


class ExampleFailure(AssertionError):
    """A rule example did not behave as declared."""


def assert_same_outputs(expected: Any, actual: Any, atol: float = 1e-5, rtol: float = 1e-5, what: str = "") -> None:
    """Compare two output trees leaf by leaf: floats within tolerance (NaN == NaN), others exactly."""
    exp_leaves, act_leaves = _tensor_leaves(expected), _tensor_leaves(actual)
    if len(exp_leaves) != len(act_leaves):
        raise ExampleFailure(f"{what}: {len(act_leaves)} output tensors, expected {len(exp_leaves)}")
    for i, (e, a) in enumerate(zip(exp_leaves, act_leaves, strict=True)):
        if e.shape != a.shape or e.dtype != a.dtype:
            raise ExampleFailure(f"{what}: output {i} is {a.dtype}{list(a.shape)}, expected {e.dtype}{list(e.shape)}")
        if e.is_floating_point() or e.is_complex():
            ok = torch.allclose(a, e, atol=atol, rtol=rtol, equal_nan=True)
        else:
            ok = torch.equal(a, e)
        if not ok:
            diff = (a.double() - e.double()).abs().nan_to_num(float("inf")).max().item()
            raise ExampleFailure(f"{what}: output {i} differs from eager (max abs diff {diff:.3g})")


def _tensor_leaves(tree: Any) -> list[torch.Tensor]:
    return [x.detach() for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]


def _export(
    module: torch.nn.Module, inputs: dict[str, Any], dynamic: bool = False, patches: bool = False
) -> torch.export.ExportedProgram:
    shapes = None
    if dynamic:
        auto = torch.export.Dim.AUTO
        shapes = {
            k: {i: auto for i in range(v.ndim)} if isinstance(v, torch.Tensor) else None for k, v in inputs.items()
        }
    if not patches:
        return torch.export.export(module, (), dict(inputs), dynamic_shapes=shapes, strict=False)
    from hfexport.rewrites import engine

    # Traced as the exporter traces: with the patch rules installed (a baked layout stays a constant, ...).
    context = engine.RewriteContext(backend="dynamo")
    with engine.patched(module, context) as session, session.active():
        return torch.export.export(module, (), dict(inputs), dynamic_shapes=shapes, strict=False)


def _check_other_inputs(rule: Any, example: Match, module: torch.nn.Module, program: Any) -> None:
    if example.other_inputs is None:
        return
    other = example.other_inputs()
    with torch.no_grad():
        expected = module(**other)
    assert_same_outputs(expected, program.module()(**other), example.atol, example.rtol, f"{rule.id} (other inputs)")


def check_example(rule: Any, example: Example) -> int:
    """Run one example of `rule`; return the hit count, raise `ExampleFailure` if it misbehaves."""
    checker = _CHECKERS.get(rule.stage)
    if checker is None:
        raise ExampleFailure(f"no example checker for stage {rule.stage!r}")
    return checker(rule, example)


def _check_patch(rule: Any, example: Example) -> int:
    from hfexport.rewrites.engine import RewriteContext
    from hfexport.rewrites.kinds.patch import PatchSession

    module, inputs = example.build()
    module.eval()
    with torch.no_grad():
        expected = module(**inputs)
    context = RewriteContext(backend=rule.meta.backends[0])
    with PatchSession(context.hit) as session:
        reason = session.install(rule, module)
        with session.active(), torch.no_grad():
            if isinstance(example, Match):
                if reason is not None:
                    raise ExampleFailure(f"{rule.id}: Match example not applicable: {reason}")
                program = _export(module, inputs, dynamic=example.other_inputs is not None)
            else:
                actual = module(**inputs)
    hits = context.hits[rule.id]
    if isinstance(example, Match):
        if hits == 0:
            raise ExampleFailure(f"{rule.id}: Match example {example.description!r} did not fire")
        assert_same_outputs(expected, program.module()(**inputs), example.atol, example.rtol, rule.id)
        _check_other_inputs(rule, example, module, program)
    else:
        if hits:
            raise ExampleFailure(f"{rule.id}: NoMatch example {example.description!r} fired {hits} time(s)")
        assert_same_outputs(expected, actual, 0.0, 0.0, rule.id)
    return hits


def _check_fx(rule: Any, example: Example) -> int:
    from hfexport.rewrites.kinds.fx import apply_fx_rule

    module, inputs = example.build()
    module.eval()
    with torch.no_grad():
        expected = module(**inputs)
    dynamic = isinstance(example, Match) and example.other_inputs is not None
    program = _export(module, inputs, dynamic=dynamic, patches=True)
    before = program.graph_module.code
    hits = apply_fx_rule(rule, program)
    if isinstance(example, Match):
        if hits == 0:
            raise ExampleFailure(f"{rule.id}: Match example {example.description!r} did not fire")
        assert_same_outputs(expected, program.module()(**inputs), example.atol, example.rtol, rule.id)
        _check_other_inputs(rule, example, module, program)
    else:
        if hits or program.graph_module.code != before:
            raise ExampleFailure(f"{rule.id}: NoMatch example {example.description!r} changed the graph")
    return hits


# One checker per stage; the ONNX, ExecuTorch and OpenVINO stages register theirs with their lowerings.
_CHECKERS: dict[str, Callable[[Any, Example], int]] = {"patch": _check_patch, "fx": _check_fx}


def register_checker(stage: str, checker: Callable[[Any, Example], int]) -> None:
    _CHECKERS[stage] = checker
