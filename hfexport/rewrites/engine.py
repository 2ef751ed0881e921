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

from hfexport.errors import ConfigError, HfExportError, InputError, MissingPackageError
from hfexport.rewrites.declines import (
    MAX_DECLINE_REASONS,
    declines_to,
)
from hfexport.rewrites.kinds.patch import PatchSession
from hfexport.rewrites.registry import RuleRegistry, default_registry, using_registry
from hfexport.rewrites.rule import Rule, RuleSelection

__all__ = ["RewriteContext", "RuleOutcome", "RuleRegistry", "apply", "default_registry", "patched", "using_registry"]


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

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("id", "stage", "kind", "hits", "status", "reason", "declined")}


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

    def hit(self, rule_id: str) -> None:
        self.hits[rule_id] += 1

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
            self.outcomes[rule.id] = RuleOutcome(rule.id, rule.stage, rule.meta.kind)
        return self.outcomes[rule.id]

    def decline(self, rule_id: str, reason: str) -> None:
        reasons = self.declined.setdefault(rule_id, Counter())
        if reason in reasons or len(reasons) < MAX_DECLINE_REASONS:
            reasons[reason] += 1

    def finish(self, rule: Rule) -> None:
        outcome = self._outcome(rule)
        outcome.hits = self.hits[rule.id]
        outcome.declined = dict(self.declined.get(rule.id, {}))
        if outcome.hits:
            outcome.status, outcome.reason = "fired", ""

    def skip(self, rule: Rule, status: str, reason: str) -> None:
        outcome = self._outcome(rule)
        outcome.status, outcome.reason = status, reason


@contextmanager
def patched(model: Any, context: RewriteContext, registry: RuleRegistry | None = None) -> Iterator[Any]:
    """Install the selected `patch` rules on `model` for the body only; always restored.

    Yields the `PatchSession`; the caller enters `session.active()` around the trace itself so the
    torch-function and module-function patches are visible to that code alone.
    """

    registry = registry or default_registry()
    rules = registry.selected("patch", context)
    session = PatchSession(context.hit, on_rule=lambda rule_id: setattr(context, "current_rule", rule_id))
    context.current_stage = "patch"
    # The stage time is install + restore; the trace in between is timed by the caller.
    start = installed = time.perf_counter()
    try:
        for rule in rules:
            context.current_rule = rule.id
            reason = session.install(rule, model)
            if reason is not None:
                context.skip(rule, "not-applicable", reason)
        context.current_rule = None
        installed = time.perf_counter()
        with declines_to(context.decline):
            yield session
    finally:
        resumed = time.perf_counter()
        try:
            session.restore()
        finally:
            for rule in rules:
                context.finish(rule)
            spent = (installed - start) + (time.perf_counter() - resumed)
            context.stage_seconds["patch"] = context.stage_seconds.get("patch", 0.0) + spent


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


def apply(
    stage: str,
    target: Any,
    context: RewriteContext,
    registry: RuleRegistry | None = None,
    where: Callable[[Rule], bool] | None = None,
    step: str | None = None,
) -> dict[str, int]:
    """Run the selected rules of a transform stage on `target` (in place); return hits per rule id.

    `where` keeps only some of the stage's rules (a lowering that runs a stage in two passes, e.g. ONNX fixes
    before the optimizer and fusions after it); `step` names the pass in timings (default: the stage).
    """
    registry = registry or default_registry()
    applier = _appliers().get(stage)
    if applier is None:
        raise ValueError(f"stage {stage!r} has no applier; known: {sorted(_appliers())} (patch uses `patched`)")
    hits: dict[str, int] = {}
    with context.stage(step or stage), declines_to(context.decline):
        for rule in registry.selected(stage, context):
            if where is not None and not where(rule):
                continue
            context.current_rule = rule.id
            count = applier(rule, target)
            if count:
                context.hits[rule.id] += count
            context.finish(rule)
            hits[rule.id] = count
    return hits


@functools.cache
def _appliers() -> dict[str, Callable[[Rule, Any], int]]:
    # Built once: the kinds are imported on the first transform stage, not at `import hfexport`.
    from hfexport.rewrites.kinds import executorch, fx, onnx, openvino

    return {
        "fx": fx.apply_fx_rule,
        "aten": onnx.apply_aten,
        "onnx": onnx.apply_onnx,
        "executorch": executorch.apply,
        "openvino": openvino.apply_openvino_rule,
    }
