"""The example harness: every rule example through the real capture, the real lowering and the real runtime.

A rule's examples (`Match`, `NoMatch` in `hfexport.rewrites.examples`) are data; this module is what proves
them. It sits at the top of the package (it imports the exporters, the lowerings and the runtimes), so the
rule engine below it never needs to know how an example is run.

Each example is exported with the public exporter of a backend (its descriptor's: `DynamoExporter`,
`OnnxExporter`, ...) under a `RuleSelection` that runs the rule under test, the rules it `requires`, and nothing
else; what fired is read from `exporter.report`, so an example goes through exactly
the code a production export goes through. The checks:

- `check_match`: the rule fires, and the backend's result equals eager on the example's inputs, run as the
  backend's `Tools.run` runs it (dynamo: the `ExportedProgram`; onnx: ONNX Runtime; executorch: the ExecuTorch
  runtime; openvino: OpenVINO CPU with the f32 precision hint; aoti: the compiled package). With `other_inputs`,
  every axis is exported dynamic (as `dynamic=True` does in production, bounded for ExecuTorch) and the program
  must also equal eager on the other inputs. An optimization must also change the graph (its op counts, the
  backend's `Ops.op_counts`) against the same export without it.
- `check_no_match`: the rule is installed or applied (a patch rule: installed on a model it applies to), it
  fires zero times, and the export is the same with and without it (graph and outputs, bit for bit).
- `fails_without` / `check_fix_needed`: a fix's Match example, exported with the rule disabled, fails (the
  export, lowering or runtime raises) or differs from eager; a fix nothing fails without is not a fix.

ONNX IR rules whose examples are ONNX text (`build()` returns `(text, feeds)`) are checked on the parsed
model: ONNX Runtime after the rule against the ONNX reference evaluator before it.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from hfexport.backends.registry import backend as descriptor
from hfexport.backends.registry import backends
from hfexport.core.errors import HfExportError
from hfexport.report import ExportReport
from hfexport.rewrites import engine
from hfexport.rewrites.engine import RuleOutcome, RuleRegistry
from hfexport.rewrites.examples import Example, ExampleFailure, Match, NoMatch, assert_same_outputs, known_failure
from hfexport.rewrites.rule import STAGES, Rule, RuleSelection

# Outcomes of a rule that ran (was installed, or applied to its target) and found nothing to change.
_RAN = ("no-match", "fired")


# -- selection and registry ----------------------------------------------------------------------------------


def _with_requirements(ids: tuple[str, ...]) -> tuple[str, ...]:
    """`ids` and, transitively, the rules they require (a needed rule is dropped without its requirements)."""
    registry, seen, todo = engine.default_registry(), list(ids), list(ids)
    while todo:
        rule_id = todo.pop()
        required = registry.get(rule_id).meta.requires if rule_id in registry.ids() else ()
        for requirement in required:
            if requirement not in seen:
                seen.append(requirement)
                todo.append(requirement)
    return tuple(seen)


def baseline_rules(backend: str) -> tuple[str, ...]:
    """The rules kept on in every example export of `backend` (`RuleMeta.baseline`): without them the backend
    cannot run a plain model at all."""
    return tuple(r.id for r in engine.default_registry().rules() if r.meta.baseline and r.applies_to(backend))


def selection_for(rule: Rule, backend: str, with_rule: bool = True, example: Example | None = None) -> RuleSelection:
    """Only `rule` (when `with_rule`), the rules it requires, those `example.needs`, and the backend's baseline
    rules: every other rule off."""
    keep = _with_requirements((*rule.meta.requires, *getattr(example, "needs", ()), *baseline_rules(backend)))
    off = tuple(f"{stage}/" for stage in STAGES)
    if with_rule:
        return RuleSelection(enable=(rule.id, *keep), disable=off)
    # The rule's own id is longer than its stage prefix, so it decides: the rule stays off.
    return RuleSelection(enable=tuple(i for i in keep if i != rule.id), disable=(*off, rule.id))


@contextlib.contextmanager
def registered(rule: Rule) -> Iterator[RuleRegistry]:
    """The default registry, with `rule` in it for the exports started in this block.

    A registered rule is used as it is. An unregistered one (a test's own rule, or a changed copy of a
    registered one, under the same id) takes the place of the rule with its id, or joins the end of its stage.
    """
    default = engine.default_registry()
    if rule.id in default.ids() and default.get(rule.id) is rule:
        yield default
        return
    registry = RuleRegistry()
    replaced = False
    for each in default.rules():
        if each.id == rule.id:
            registry.register(rule)
            replaced = True
        else:
            registry.register(each)
    if not replaced:
        # Registered after the rules of its stage; the registry keeps stages apart, so order is per stage.
        registry.register(rule)
    registry.check_requirements()
    with engine.using_registry(registry):
        yield registry


# -- exporting and running -----------------------------------------------------------------------------------


@dataclass
class Exported:
    """One export of an example: the backend's native object (or the error), and the export's report."""

    backend: str
    result: Any = None
    error: BaseException | None = None
    report: ExportReport | None = None

    def outcome(self, rule_id: str) -> RuleOutcome | None:
        if self.report is None:
            return None
        return next((o for o in self.report.rules if o.id == rule_id), None)

    def hits(self, rule_id: str) -> int:
        outcome = self.outcome(rule_id)
        return outcome.hits if outcome is not None else 0


def _exporter_and_config(backend: str, selection: RuleSelection, dynamic: bool, opset: int | None) -> tuple[Any, Any]:
    """The backend's public exporter and its config (the example's ONNX opset where the config has one)."""
    known = descriptor(backend)
    config_class = known.config.load()
    fields = {"opset_version": opset} if opset is not None and hasattr(config_class, "opset_version") else {}
    return known.exporter.load()(), config_class(dynamic=dynamic, rules=selection, **fields)


def export(
    backend: str,
    module: torch.nn.Module,
    inputs: Mapping[str, Any],
    selection: RuleSelection,
    dynamic: bool = False,
    opset: int | None = None,
) -> Exported:
    """Export `module` on `inputs` with the public exporter of `backend`; an error is kept, not raised."""
    exporter, config = _exporter_and_config(backend, selection, dynamic, opset)
    if dynamic:
        config = descriptor(backend).tools.load().example_config(config, inputs)
    exported = Exported(backend)
    try:
        exported.result = exporter.export(module, dict(inputs), config)
    except Exception as exc:  # the caller decides whether a failed export is a failure
        exported.error = exc
    exported.report = exporter.report
    return exported


def run(backend: str, result: Any, inputs: Mapping[str, Any]) -> Any:
    """Run an export's native object on forward kwargs `inputs`, in its runtime; return its outputs."""
    return descriptor(backend).tools.load().run(result, inputs)


def leaves(tree: Any) -> list[torch.Tensor]:
    """The values of an output tree as tensors: numpy arrays and Python numbers too (a size a graph returns is
    a 0-d int64 output of ONNX and OpenVINO models); None and strings are dropped."""
    import numpy as np

    found = []
    for leaf in pytree.tree_leaves(tree):
        if isinstance(leaf, torch.Tensor):
            found.append(leaf.detach())
        elif isinstance(leaf, np.ndarray | np.generic):
            found.append(torch.from_numpy(np.array(leaf)))
        elif isinstance(leaf, bool | int | float):
            found.append(torch.tensor(leaf))
    return found


def eager(module: torch.nn.Module, inputs: Mapping[str, Any]) -> list[torch.Tensor]:
    with torch.no_grad():
        return leaves(module(**inputs))


def structure(backend: str, result: Any) -> Any:
    """What an export produced, to prove that a rule changed nothing: comparable with `==`."""
    return descriptor(backend).tools.load().structure(result)


def op_counts(backend: str, result: Any) -> Counter[str]:
    """How many nodes of each op an export has: what an optimization must change."""
    return Counter(descriptor(backend).ops.load().op_counts(result))


# -- the checks ----------------------------------------------------------------------------------------------


def _is_text(built: Any) -> bool:
    return isinstance(built, str)


def _opset(rule: Rule, example: Example) -> int | None:
    """The opset to export an ONNX example at: the example's, else the newest the rule is for."""
    if example.opset is not None:
        return example.opset
    max_opset = getattr(rule, "max_opset", None)
    if max_opset is None:
        return None
    from hfexport.lowerings.onnx import newest_opset

    return min(max_opset, newest_opset())


def _what(rule: Rule, example: Example, backend: str) -> str:
    kind = "Match" if isinstance(example, Match) else "NoMatch"
    text = f"{rule.id} [{backend}] {kind} {example.description!r}"
    reason = getattr(example, "reason", "")
    return f"{text} (no match because: {reason})" if reason else text


def _first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) < 3000 else text[:3000] + " ..."


def _dynamic(example: Example) -> bool:
    return isinstance(example, Match) and example.other_inputs is not None


def _runs(example: Example, inputs: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    runs: list[tuple[str, Mapping[str, Any]]] = [("inputs", inputs)]
    if _dynamic(example):
        runs.append(("other inputs", example.other_inputs()))
    return runs


def _export_example(
    rule: Rule, example: Example, backend: str, module: torch.nn.Module, inputs: Any, with_rule: bool = True
) -> Exported:
    selection = selection_for(rule, backend, with_rule, example)
    return export(backend, module, inputs, selection, _dynamic(example), _opset(rule, example))


@dataclass
class MatchResult:
    """What a Match check found: the hits, and the backends' op counts with and without the rule."""

    hits: int
    op_counts: Counter[str] = field(default_factory=Counter)
    op_counts_without: Counter[str] | None = None


def check_match(rule: Rule, example: Match, backend: str) -> MatchResult:
    """The rule fires on the example exported for `backend`, and the result equals eager (on `other_inputs()`
    too); an optimization changes the op counts. Raises `ExampleFailure`."""
    what = _what(rule, example, backend)
    with registered(rule):
        built, inputs = example.build()
        if _is_text(built):
            return _check_text_match(rule, example, built, inputs, what)
        module = built.eval()
        runs = [(name, feed, eager(module, feed)) for name, feed in _runs(example, inputs)]
        exported = _export_example(rule, example, backend, module, inputs)
        if exported.error is not None:
            raise ExampleFailure(f"{what}: the export failed: {_first_line(exported.error)}") from exported.error
        hits = exported.hits(rule.id)
        if hits == 0:
            outcome = exported.outcome(rule.id)
            status = f"{outcome.status}{': ' + outcome.reason if outcome.reason else ''}" if outcome else "not run"
            raise ExampleFailure(f"{what}: did not fire ({status})")
        for name, feed, expected in runs:
            try:
                actual = leaves(run(backend, exported.result, feed))
            except Exception as exc:
                raise ExampleFailure(f"{what}: the runtime failed on the {name}: {_first_line(exc)}") from exc
            assert_same_outputs(expected, actual, example.atol, example.rtol, f"{what} on the {name}")
        result = MatchResult(hits, op_counts(backend, exported.result))
        if rule.meta.kind == "optimization":
            without = _export_example(rule, example, backend, module, inputs, with_rule=False)
            if without.error is not None:
                raise ExampleFailure(f"{what}: the export without the rule failed: {_first_line(without.error)}")
            result.op_counts_without = op_counts(backend, without.result)
            if result.op_counts_without == result.op_counts:
                raise ExampleFailure(f"{what}: fired {hits} time(s) but the graph has the same ops as without it")
        return result


def check_no_match(rule: Rule, example: NoMatch, backend: str) -> None:
    """The rule runs on the example exported for `backend` (installed, for a patch rule), fires zero times, and
    the export is the same with and without it. Raises `ExampleFailure`."""
    what = _what(rule, example, backend)
    with registered(rule):
        built, inputs = example.build()
        if _is_text(built):
            return _check_text_no_match(rule, example, built, inputs, what)
        module = built.eval()
        exported = _export_example(rule, example, backend, module, inputs)
        outcome = exported.outcome(rule.id)
        status = outcome.status if outcome is not None else "not run"
        if status not in _RAN and example.applies:
            reason = f": {outcome.reason}" if outcome is not None and outcome.reason else ""
            raise ExampleFailure(
                f"{what}: the rule did not run ({status}{reason}); a NoMatch must be a model the rule is installed "
                "on or applied to, where it finds nothing to change"
            )
        if status in _RAN and not example.applies:
            raise ExampleFailure(f"{what}: declared applies=False, but the rule ran ({status})")
        hits = exported.hits(rule.id)
        if hits:
            raise ExampleFailure(f"{what}: fired {hits} time(s)")
        without = _export_example(rule, example, backend, module, inputs, with_rule=False)
        if exported.error is not None or without.error is not None:
            # A model no backend takes (complex values on ONNX) may still be a NoMatch: the rule ran, left it
            # alone, and the export fails exactly as it does without the rule.
            if _first_line(exported.error or Exception()) != _first_line(without.error or Exception()):
                failed = exported.error or without.error
                which = "with" if exported.error is not None else "without"
                raise ExampleFailure(f"{what}: the export {which} the rule failed: {_first_line(failed)}") from failed
            return None
        if structure(backend, exported.result) != structure(backend, without.result):
            raise ExampleFailure(f"{what}: fired 0 times, but the export differs from the one without the rule")
        actual, error = _try_run(backend, exported.result, inputs)
        actual_without, error_without = _try_run(backend, without.result, inputs)
        if error is not None or error_without is not None:
            # As for the export: a program the runtime refuses (a kernel it lacks) fails alike without the rule.
            if _first_line(error or Exception()) != _first_line(error_without or Exception()):
                failed = error or error_without
                which = "with" if error is not None else "without"
                raise ExampleFailure(f"{what}: the runtime failed {which} the rule: {_first_line(failed)}") from failed
            return None
        assert_same_outputs(actual_without, actual, 0.0, 0.0, f"{what}: with the rule against without it")
        return None


def _try_run(backend: str, result: Any, inputs: Mapping[str, Any]) -> tuple[list[torch.Tensor], Exception | None]:
    try:
        return leaves(run(backend, result, inputs)), None
    except Exception as exc:  # compared by the caller
        return [], exc


def fails_without(rule: Rule, example: Match, backend: str) -> str | None:
    """How `example` fails on `backend` with `rule` disabled (the export, lowering or runtime raises, or the
    result differs from eager), or None when it works without the rule."""
    with registered(rule):
        built, inputs = example.build()
        if _is_text(built):
            return _text_fails_without(example, built, inputs)
        module = built.eval()
        runs = [(name, feed, eager(module, feed)) for name, feed in _runs(example, inputs)]
        without = _export_example(rule, example, backend, module, inputs, with_rule=False)
        if without.error is not None:
            stage = getattr(without.error, "stage", None) if isinstance(without.error, HfExportError) else None
            return f"the export fails{f' at stage {stage!r}' if stage else ''}: {_first_line(without.error)}"
        for name, feed, expected in runs:
            try:
                actual = leaves(run(backend, without.result, feed))
            except Exception as exc:
                return f"the runtime fails on the {name}: {_first_line(exc)}"
            try:
                assert_same_outputs(expected, actual, example.atol, example.rtol, f"on the {name}")
            except ExampleFailure as exc:
                return f"the result differs from eager: {exc}"
        return None


@dataclass
class FixProof:
    """Which Match example, on which backend, fails without the fix, and how."""

    example: Match
    backend: str
    how: str


def check_fix_needed(rule: Rule, backends: tuple[str, ...] | None = None) -> FixProof:
    """Some Match example of the fix `rule` fails without it on one of `backends` (default: the rule's, the slowest
    lowerings last (`Backend.try_last`: ExecuTorch), tried only where no other backend shows the need).

    Tries the Match examples in order and each on the backends in order, and stops at the first failure.
    Raises `ExampleFailure` when every one works without the rule.
    """
    default = sorted(rule.meta.backends, key=lambda b: descriptor(b).try_last)
    backends = tuple(b for b in (backends or default) if b in rule.meta.backends)
    tried = []
    for example in rule.meta.examples:
        if not isinstance(example, Match):
            continue
        for backend in (b for b in backends if b in example_backends(rule, example)):
            how = fails_without(rule, example, backend)
            if how is not None:
                return FixProof(example, backend, how)
            tried.append(f"{example.description!r} on {backend}")
    raise ExampleFailure(f"{rule.id}: every Match example works without the rule ({'; '.join(tried)})")


def example_backends(rule: Rule, example: Example) -> tuple[str, ...]:
    """The backends an example is checked on, among those it names (`example.backends`, default: the rule's): a
    Match on each of them and on each backend that runs the rules of one of them (AOTInductor runs Dynamo's); a
    NoMatch on the first of them of each variant of the rule (`Rule.variants()`: backends that share the rule's
    body).

    One backend per variant is enough for a NoMatch: a rule that fires zero times hands its stage's output on
    unchanged, and the later stages are deterministic, so the same graph on one backend is the same on every one.
    """
    named = tuple(b for b in rule.meta.backends if not example.backends or b in example.backends)
    if isinstance(example, Match):
        runs_theirs = tuple(b.name for b in backends() if b.rules in named and b.name not in named)
        return (*named, *runs_theirs)
    firsts = (next((b for b in variant if b in named), None) for variant in rule.variants())
    return tuple(b for b in firsts if b is not None)


def check_example(rule: Rule, example: Example, backends: tuple[str, ...] | None = None) -> int:
    """Check one example on each of `backends` (default: every backend it is checked on); return the hits of a
    Match summed over the backends (0 for a NoMatch). Raises `ExampleFailure`."""
    hits = 0
    for backend in backends or example_backends(rule, example):
        if isinstance(example, Match):
            hits += check_match(rule, example, backend).hits
        else:
            check_no_match(rule, example, backend)
    return hits


# -- what a test run checks ----------------------------------------------------------------------------------


@dataclass
class ExampleCheck:
    """One example of a rule on one backend, as a test run checks it (tests/rewrites/test_examples.py for hfexport's
    rules, `hfexport rules test MODULE` for a module of rules from outside)."""

    rule: Rule
    index: int  # the example's place in `rule.meta.examples`
    backend: str
    # In the default test tier (else checked only under `pytest -m slow`, or by `hfexport rules test --all`).
    default_tier: bool

    @property
    def example(self) -> Example:
        return self.rule.meta.examples[self.index]

    @property
    def id(self) -> str:
        kind = "match" if isinstance(self.example, Match) else "nomatch"
        return f"{self.rule.id}[{kind}{self.index}-{self.backend}]"

    @property
    def known_failure(self) -> str | None:
        """Why the example is declared to fail on this backend (a strict expected failure), or None."""
        return known_failure(self.example, self.backend)

    def run(self) -> int:
        """Check the example; return the hits of a Match (0 for a NoMatch). Raises `ExampleFailure`."""
        if isinstance(self.example, Match):
            return check_match(self.rule, self.example, self.backend).hits
        check_no_match(self.rule, self.example, self.backend)
        return 0


def _default_tier(rule: Rule, example: Example, backend: str) -> bool:
    """The default tier checks, for each variant of a rule (its backends that share one body: all of them for most
    rules), the first Match and the first NoMatch checked on the variant's first backend (the trace for a patch,
    the lowering for a backend rule), unless the example is marked `slow`. A backend that runs another's rules
    (aoti, Dynamo's) is none of the rule's: its checks are all `slow`."""
    variant = next((v for v in rule.variants() if backend in v), ())
    if example.slow or backend not in variant[:1]:
        return False
    on_backend = (e for e in rule.meta.examples if backend in example_backends(rule, e))
    return next(e for e in on_backend if type(e) is type(example)) is example


def example_checks(rules: Iterable[Rule]) -> list[ExampleCheck]:
    """Every example of `rules` on every backend it is checked on (`example_backends`), in order, each marked
    whether the default tier checks it."""
    return [
        ExampleCheck(rule, index, backend, _default_tier(rule, example, backend))
        for rule in rules
        for index, example in enumerate(rule.meta.examples)
        for backend in example_backends(rule, example)
    ]


# -- ONNX text examples --------------------------------------------------------------------------------------


def _ort(proto: Any, feeds: Mapping[str, Any]) -> list[Any]:
    import onnxruntime as ort

    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, dict(feeds))


def _parse(text: str) -> tuple[Any, Any]:
    import onnx
    import onnx_ir as ir

    proto = onnx.parser.parse_model(text)
    return proto, ir.serde.deserialize_model(proto)


def _apply_text_rule(rule: Rule, model: Any) -> int:
    registry = engine.default_registry()
    for required in rule.meta.requires:
        engine.apply_rule(registry.get(required), model)
    return engine.apply_rule(rule, model).hits


def _reference(proto: Any, feeds: Mapping[str, Any]) -> list[torch.Tensor]:
    from onnx.reference import ReferenceEvaluator

    return leaves(ReferenceEvaluator(proto).run(None, dict(feeds)))


def _check_text_match(rule: Rule, example: Match, text: str, feeds: Any, what: str) -> MatchResult:
    import onnx_ir as ir

    proto, model = _parse(text)
    before = Counter(f"{n.domain}::{n.op_type}" for n in model.graph.all_nodes())
    hits = _apply_text_rule(rule, model)
    if hits == 0:
        raise ExampleFailure(f"{what}: did not fire")
    after = ir.serde.serialize_model(model)
    assert_same_outputs(_reference(proto, feeds), leaves(_ort(after, feeds)), example.atol, example.rtol, what)
    counts = Counter(f"{n.domain}::{n.op_type}" for n in model.graph.all_nodes())
    if rule.meta.kind == "optimization" and counts == before:
        raise ExampleFailure(f"{what}: fired {hits} time(s) but the graph has the same ops as without it")
    return MatchResult(hits, counts, before)


def _check_text_no_match(rule: Rule, example: NoMatch, text: str, feeds: Any, what: str) -> None:
    import onnx
    import onnx_ir as ir

    proto, model = _parse(text)
    hits = _apply_text_rule(rule, model)
    if hits or onnx.printer.to_text(ir.serde.serialize_model(model)) != onnx.printer.to_text(proto):
        raise ExampleFailure(f"{what}: changed the model ({hits} hit(s))")


def _text_fails_without(example: Match, text: str, feeds: Any) -> str | None:
    proto, _ = _parse(text)
    try:
        actual = leaves(_ort(proto, feeds))
    except Exception as exc:
        return f"ONNX Runtime fails on the model: {_first_line(exc)}"
    try:
        assert_same_outputs(_reference(proto, feeds), actual, example.atol, example.rtol, "ONNX Runtime")
    except ExampleFailure as exc:
        return f"ONNX Runtime differs from the reference evaluator: {exc}"
    return None


# -- helpers for tests of rule kinds -------------------------------------------------------------------------


def export_program(
    module: torch.nn.Module, inputs: Mapping[str, Any], dynamic: bool = False
) -> torch.export.ExportedProgram:
    """A plain `torch.export.export` of `module` (every rule off, every axis `Dim.AUTO` when `dynamic`): the
    program a rule kind's own tests apply a rule to by hand."""
    shapes = None
    if dynamic:
        from hfexport.frontends.torch_export import auto_dynamic_shapes

        shapes = auto_dynamic_shapes(inputs)
    with torch.no_grad():
        return torch.export.export(module, (), dict(inputs), dynamic_shapes=shapes, strict=False)


def lower_to_executorch(program: torch.export.ExportedProgram) -> Any:
    """Lower `program` as it is (no rule) with XNNPACK and load it: an `ExecutorchProgram` to `.run(inputs)`."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    from hfexport.runtime.executorch import ExecutorchProgram

    edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()])
    return ExecutorchProgram(edge.to_executorch())
