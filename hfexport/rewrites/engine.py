"""The rule engine: registry, selection, application per stage, and hit counting.

Rule bodies never count. The engine wraps every rule it runs and records, per export, how often each
rule fired, which rules did not apply and why, and how long each stage took.
"""

from __future__ import annotations

import functools
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from hfexport.core.errors import ConfigError, HfExportError, InputError, MissingPackageError
from hfexport.rewrites.declines import (
    MAX_DECLINE_REASONS,
    declines_to,
)
from hfexport.rewrites.kinds.patch import PatchSession
from hfexport.rewrites.registry import RuleRegistry, default_registry, using_registry
from hfexport.rewrites.rule import PHASES, Applied, Rule, RuleSelection

__all__ = [
    "RewriteContext",
    "RuleOutcome",
    "RuleRegistry",
    "StageResult",
    "apply",
    "apply_rule",
    "default_registry",
    "patched",
    "using_registry",
]


@dataclass
class RuleOutcome:
    """What one rule did in one export."""

    id: str
    stage: str
    kind: str
    hits: int = 0
    # fired | no-match | not-applicable | disabled | other-backend
    status: str = "no-match"
    reason: str = ""
    # Why the rule left sites alone that its pattern matched: each reason its check (or replacement) gave,
    # with how often. A rule that "matched nothing" often matched and declined; this says why.
    declined: dict[str, int] = field(default_factory=dict)
    # For a rule from outside hfexport, the module (and distribution) it came from (`Rule.origin`); "" for hfexport's.
    origin: str = ""

    def to_dict(self) -> dict[str, Any]:
        data = {k: getattr(self, k) for k in ("id", "stage", "kind", "hits", "status", "reason", "declined")}
        if self.origin:
            data["origin"] = self.origin
        return data


# Who hears stage changes of the exports started in this context (the CLI's progress display).
_STAGE_LISTENER: ContextVar[Callable[[str], None] | None] = ContextVar("hfexport_stage_listener", default=None)


@contextmanager
def stage_listener(callback: Callable[[str], None] | None) -> Iterator[None]:
    """Call `callback(stage)` whenever an export started inside this block enters a stage."""
    token = _STAGE_LISTENER.set(callback)
    try:
        yield
    finally:
        _STAGE_LISTENER.reset(token)


# Test hook: called at every point an export passes (see `fault_injection`). A ContextVar, so only the
# exports started in the injecting context (thread) see it.
_FAULT_HOOK: ContextVar[Callable[[str, str | None], None] | None] = ContextVar("hfexport_fault_hook", default=None)


@contextmanager
def fault_injection(hook: Callable[[str, str | None], None]) -> Iterator[None]:
    """Call `hook(stage, rule_id)` at every point of the exports started in this block, for fault-injection tests.

    The points are: entering a stage (`rule_id` None: "patch", "trace", "fx", "aten", "translate", "onnx",
    "executorch", "edge", "to_executorch", "openvino", "convert", "lower", "quantize", "save", ...) and
    starting a rule in it (installing a patch, applying an FX/ATen/ONNX/backend rule). A hook that raises
    makes the export fail at exactly that point; the exporter must then report the stage and rule and leave
    the model and the process as they were (tests/test_reliability_faults.py).
    """
    token = _FAULT_HOOK.set(hook)
    try:
        yield
    finally:
        _FAULT_HOOK.reset(token)


# Errors that say what the caller must change; a stage lets them through as they are.
PASS_THROUGH = (HfExportError, InputError, ConfigError, MissingPackageError)

# Steps that fail like a stage (errors and the fault hook name them) but that the progress display does not
# list: the Dynamo exporter's functionalisation of a program with in-place ops, a short step of most exports.
QUIET_STAGES = frozenset({"lower"})


@dataclass
class RewriteContext:
    """Per-export state the engine owns: the backend, the selection, and what fired.

    `on_stage(stage)` is called each time `current_stage` changes to a new stage (default: the listener of
    `stage_listener`), so progress can be shown without the pipeline knowing who watches.
    """

    backend: str
    selection: RuleSelection = field(default_factory=RuleSelection)
    hits: Counter[str] = field(default_factory=Counter)
    outcomes: dict[str, RuleOutcome] = field(default_factory=dict)
    declined: dict[str, Counter[str]] = field(default_factory=dict)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    # Set by the stage that is running, so a failure can name it.
    current_stage: str | None = None
    current_rule: str | None = None
    on_stage: Callable[[str], None] | None = field(default_factory=_STAGE_LISTENER.get, repr=False, compare=False)
    fault_hook: Callable[[str, str | None], None] | None = field(
        default_factory=_FAULT_HOOK.get, repr=False, compare=False
    )

    def __setattr__(self, name: str, value: Any) -> None:
        # Stages are entered by assigning current_stage (here and in the lowerings), rules by assigning
        # current_rule: one place to notify. The value is stored first, so a hook that raises leaves the
        # context naming the point it failed at.
        previous = self.__dict__.get(name)
        object.__setattr__(self, name, value)
        if value is None or name not in ("current_stage", "current_rule"):
            return
        if name == "current_stage" and value != previous:
            listener = self.__dict__.get("on_stage")
            if listener is not None and value not in QUIET_STAGES:
                listener(value)
            hook = self.__dict__.get("fault_hook")
            if hook is not None:
                hook(value, None)
        elif name == "current_rule":
            hook = self.__dict__.get("fault_hook")
            if hook is not None:
                hook(self.__dict__.get("current_stage") or "", value)

    def hit(self, rule_id: str, count: int = 1) -> None:
        """Count `count` hits of `rule_id`, also those that come after its stage ran (an ATen override's dispatches
        during translation, a patch's calls during the trace): a rule that ran shows them at once."""
        self.hits[rule_id] += count
        outcome = self.outcomes.get(rule_id)
        if outcome is not None and outcome.status in ("no-match", "fired"):
            outcome.hits, outcome.status, outcome.reason = self.hits[rule_id], "fired", ""

    @contextmanager
    def stage(
        self, name: str, model: str | None = None, message: Callable[[BaseException], str] | None = None
    ) -> Iterator[None]:
        """Run one pipeline stage: the one place that names, times and reports a stage.

        Entering tells the progress listener and the fault hook; the time spent is added to `stage_seconds`;
        an exception leaves as `HfExportError` naming this stage, the rule that was running (if any) and the
        model (`message(exc)` words it; default `"<Type>: <text>"`). API errors the caller's input caused
        (`InputError`, `ConfigError`, ...) and an `HfExportError` from a nested stage pass through unchanged.
        """
        start = time.perf_counter()
        self.current_rule = None
        self.current_stage = name
        try:
            yield
        except PASS_THROUGH:
            raise
        except Exception as exc:
            detail = message(exc) if message is not None else f"{type(exc).__name__}: {exc}"
            raise HfExportError(detail, stage=name, rule_id=self.current_rule, model=model) from exc
        finally:
            self.stage_seconds[name] = self.stage_seconds.get(name, 0.0) + time.perf_counter() - start
        # Only on success: after a failure, `current_rule` still names the rule that raised, for the message.
        self.current_rule = None

    def _outcome(self, rule: Rule) -> RuleOutcome:
        if rule.id not in self.outcomes:
            origin = str(rule.origin) if rule.origin is not None else ""
            self.outcomes[rule.id] = RuleOutcome(rule.id, rule.stage, rule.meta.kind, origin=origin)
        return self.outcomes[rule.id]

    def decline(self, rule_id: str, reason: str, count: int = 1) -> None:
        reasons = self.declined.setdefault(rule_id, Counter())
        if reason in reasons or len(reasons) < MAX_DECLINE_REASONS:
            reasons[reason] += count
            if rule_id in self.outcomes:
                self.outcomes[rule_id].declined = dict(reasons)

    def finish(self, rule: Rule) -> None:
        """Record that `rule` ran: its outcome from the hits and declines so far (later ones update it)."""
        outcome = self._outcome(rule)
        outcome.hits = self.hits[rule.id]
        outcome.declined = dict(self.declined.get(rule.id, {}))
        if outcome.hits:
            outcome.status, outcome.reason = "fired", ""

    def skip(self, rule: Rule, status: str, reason: str) -> None:
        outcome = self._outcome(rule)
        outcome.status, outcome.reason = status, reason


@contextmanager
def patched(
    model: Any, context: RewriteContext, registry: RuleRegistry | None = None, model_name: str | None = None
) -> Iterator[Any]:
    """Install the selected `patch` rules on `model` for the body only; always restored.

    The installation is stage `patch` (entered, timed and reported by `context.stage` as every stage is); the body,
    the trace, is timed by the caller. Yields the `PatchSession`; the caller enters `session.active()` around the
    trace itself so the module-function patches are visible to that code alone. `model_name` names the model in an
    error.
    """

    registry = registry or default_registry()
    rules = registry.selected("patch", context)
    session = PatchSession(context.hit, on_rule=lambda rule_id: setattr(context, "current_rule", rule_id))
    try:
        with context.stage("patch", model=model_name):
            for rule in rules:
                context.current_rule = rule.id
                reason = session.install(rule, model, context.backend)
                if reason is not None:
                    context.skip(rule, "not-applicable", reason)
        with declines_to(context.decline):
            yield session
    finally:
        try:
            session.restore()
        finally:
            for rule in rules:
                context.finish(rule)


@contextmanager
def recording(
    model: Any, selection: RuleSelection | None = None, registry: RuleRegistry | None = None
) -> Iterator[None]:
    """Install the patch rules marked `records` that `selection` runs on `model` for the body only, on every backend.

    `decompose_for_generation` runs generate under them: a rule that moves state a model keeps on its modules into
    the cache generate carries (`patch/rglru-state-in-cache`) must run there too, or the recorded decode step's
    cache would not hold the state its program takes. The export's selection decides, so a rule disabled for the
    export is off here too. Their hits are not counted (no export is running).
    """
    registry = registry or default_registry()
    plan = registry.plan(selection if selection is not None else RuleSelection())
    rules = [rule for rule in registry.rules("patch") if getattr(rule, "records", False) and plan[rule.id] is None]
    session = PatchSession(lambda _rule_id: None)
    try:
        for rule in rules:
            session.install(rule, model)
        with session.active():
            yield
    finally:
        session.restore()


@dataclass
class StageResult:
    """What one phase of a stage did: hits per rule id (every rule that ran, 0 included), and what the rules handed
    to the lowering, in rule order (an edge pass, a verifier exception, a translation: `Applied.outputs`)."""

    hits: dict[str, int] = field(default_factory=dict)
    outputs: list[Any] = field(default_factory=list)


def apply(
    stage: str,
    target: Any,
    context: RewriteContext,
    registry: RuleRegistry | None = None,
    *,
    phase: str | None = None,
    step: str | None = None,
) -> StageResult:
    """Run the selected rules of one phase of a transform stage on `target` (in place).

    `phase` is the phase of the stage the lowering is at (`rule.PHASES`; it may be left out for a stage that has
    one); only the rules of that phase run. `step` names the pass in timings and errors (default: the stage).
    """
    registry = registry or default_registry()
    phases = PHASES.get(stage, ())
    if stage == "patch" or not phases:
        raise ValueError(f"stage {stage!r} is not a transform stage; known: {sorted(PHASES)} (patch uses `patched`)")
    if phase is None:
        if len(phases) != 1:
            raise ValueError(f"stage {stage!r} runs in phases {phases}: name the one to run")
        phase = phases[0]
    elif phase not in phases:
        raise ValueError(f"stage {stage!r} has no phase {phase!r}; its phases: {phases}")
    result = StageResult()
    with context.stage(step or stage), declines_to(context.decline):
        for rule in registry.selected(stage, context):
            if rule.phase != phase:
                continue
            context.current_rule = rule.id
            rule_id = rule.id
            applied = apply_rule(rule, target, hit=lambda rule_id=rule_id: context.hit(rule_id))
            if applied.not_applicable:
                context.skip(rule, "not-applicable", applied.not_applicable)
            if applied.hits:
                context.hit(rule.id, applied.hits)
            for reason, count in applied.declined.items():
                context.decline(rule.id, reason, count)
            context.finish(rule)
            result.hits[rule.id] = applied.hits
            result.outputs.extend(applied.outputs)
    return result


def apply_rule(rule: Rule, target: Any, hit: Callable[[], None] | None = None) -> Applied:
    """Apply one rule of a transform stage to `target` (in place) with its kind's applier, outside any export (the
    engine's `apply` counts and records what it returns): `hit()` is called for each hit that comes later, such as
    an ATen override's dispatch during translation."""
    for kind in type(rule).__mro__:
        applier = _appliers().get(kind)
        if applier is not None:
            return applier(rule, target, hit)
    known = sorted(kind.__name__ for kind in _appliers())
    raise TypeError(f"{type(rule).__name__} is not a transform rule kind; known: {known}")


@functools.cache
def _appliers() -> dict[type, Callable[[Rule, Any, Callable[[], None] | None], Applied]]:
    # Built once: the kinds are imported on the first transform stage, not at `import hfexport`.
    from hfexport.rewrites.kinds import executorch, fx, onnx, openvino

    return {
        fx.NodeRule: fx.apply_node_rule,
        fx.FxGraphRule: fx.apply_graph_rule,
        onnx.AtenOverride: onnx.apply_aten,
        onnx.OnnxRewriteRule: onnx.apply_onnx_rule,
        executorch.ExecutorchVerifierExceptionRule: executorch.apply_verifier_exception_rule,
        executorch.ExecutorchEdgePassRule: executorch.apply_edge_pass_rule,
        openvino.OpenVINOModelRule: openvino.apply_model_rule,
    }
