"""The rule engine: registry, selection, application per stage, and hit counting.

Rule bodies never count. The engine wraps every rule it runs and records, per export, how often each
rule fired, which rules did not apply and why, and how long each stage took.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from hfexport.rewrites.rule import STAGES, Rule, RuleDefinitionError, RuleSelection


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

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("id", "stage", "kind", "hits", "status", "reason")}


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

    def _outcome(self, rule: Rule) -> RuleOutcome:
        if rule.id not in self.outcomes:
            self.outcomes[rule.id] = RuleOutcome(rule.id, rule.stage, rule.meta.kind)
        return self.outcomes[rule.id]

    def finish(self, rule: Rule) -> None:
        outcome = self._outcome(rule)
        outcome.hits = self.hits[rule.id]
        if outcome.hits:
            outcome.status, outcome.reason = "fired", ""

    def skip(self, rule: Rule, status: str, reason: str) -> None:
        outcome = self._outcome(rule)
        outcome.status, outcome.reason = status, reason


class RuleRegistry:
    """Rules by stage, in registration order (the order they run in)."""

    def __init__(self) -> None:
        self._by_stage: dict[str, list[Rule]] = {stage: [] for stage in STAGES}
        self._by_id: dict[str, Rule] = {}

    def register(self, rule: Rule) -> Rule:
        from hfexport.rewrites.examples import Match, NoMatch

        if not isinstance(rule, Rule):
            raise RuleDefinitionError(f"not a rule: {rule!r}")
        if rule.id in self._by_id:
            raise RuleDefinitionError(f"duplicate rule id {rule.id!r}")
        examples = rule.meta.examples
        if not any(isinstance(e, Match) for e in examples) or not any(isinstance(e, NoMatch) for e in examples):
            raise RuleDefinitionError(f"rule {rule.id} needs at least one Match and one NoMatch example")
        self._by_stage[rule.stage].append(rule)
        self._by_id[rule.id] = rule
        return rule

    def check_requirements(self) -> None:
        """Every `requires` names a registered rule (called once the registry is complete)."""
        for rule in self._by_id.values():
            for required in rule.meta.requires:
                if required not in self._by_id:
                    raise RuleDefinitionError(f"rule {rule.id} requires {required!r}, which is not registered")

    def rules(self, stage: str | None = None) -> list[Rule]:
        if stage is None:
            return [r for s in STAGES for r in self._by_stage[s]]
        return list(self._by_stage[stage])

    def get(self, rule_id: str) -> Rule:
        try:
            return self._by_id[rule_id]
        except KeyError:
            raise KeyError(f"no rule {rule_id!r}; `hfexport rules list` shows the registered ids") from None

    def ids(self) -> list[str]:
        return list(self._by_id)

    def validate_selection(self, selection: RuleSelection) -> None:
        unknown = selection.unknown_patterns(self.ids())
        if unknown:
            raise ValueError(
                f"rule selection names no registered rule: {unknown}; use an id or an id prefix such as "
                "'fx/' or 'patch/sdpa' (`hfexport rules list` shows them)"
            )

    def plan(self, selection: RuleSelection) -> dict[str, str | None]:
        """Rule id -> None when it runs, else why not; requirements are honoured in both directions.

        A selected rule pulls in the rules it `requires` (unless the selection disables one of them, which
        drops the dependent too), so `--disable`/ablation never runs a rule without what it needs.
        """
        verdict: dict[str, str | None] = {
            i: None if selection.is_enabled(r.meta) else "disabled by the rule selection"
            for i, r in self._by_id.items()
        }
        changed = True
        while changed:
            changed = False
            for rule_id, rule in self._by_id.items():
                if verdict[rule_id] is not None:
                    continue
                for required in rule.meta.requires:
                    if verdict[required] is None:
                        continue
                    if selection.disables(self._by_id[required].meta) or verdict[required].startswith("requires"):
                        verdict[rule_id] = f"requires {required}, which is not running ({verdict[required]})"
                    else:
                        verdict[required] = None  # pulled in by its dependent
                    changed = True
        return verdict

    def selected(self, stage: str, context: RewriteContext) -> list[Rule]:
        """The rules of `stage` that run for this context; the others are recorded as skipped."""
        plan = self.plan(context.selection)
        chosen = []
        for rule in self._by_stage[stage]:
            if not rule.applies_to(context.backend):
                context.skip(rule, "other-backend", f"only for {', '.join(rule.meta.backends)}")
            elif plan[rule.id] is not None:
                context.skip(rule, "disabled", plan[rule.id])
            else:
                chosen.append(rule)
        return chosen


@contextmanager
def _timed(context: RewriteContext, stage: str) -> Iterator[None]:
    start = time.perf_counter()
    context.current_stage = stage
    try:
        yield
    finally:
        context.stage_seconds[stage] = context.stage_seconds.get(stage, 0.0) + time.perf_counter() - start
    # Only on success: after a failure, `current_rule` still names the rule that raised, for the error message.
    context.current_rule = None


@contextmanager
def patched(model: Any, context: RewriteContext, registry: RuleRegistry | None = None) -> Iterator[Any]:
    """Install the selected `patch` rules on `model` for the body only; always restored.

    Yields the `PatchSession`; the caller enters `session.active()` around the trace itself so the
    torch-function and module-function patches are visible to that code alone.
    """
    from hfexport.rewrites.kinds.patch import PatchSession

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


def apply(stage: str, target: Any, context: RewriteContext, registry: RuleRegistry | None = None) -> dict[str, int]:
    """Run the selected rules of a transform stage on `target` (in place); return hits per rule id."""
    registry = registry or default_registry()
    applier = _APPLIERS.get(stage)
    if applier is None:
        raise ValueError(f"stage {stage!r} has no applier; known: {sorted(_APPLIERS)} (patch uses `patched`)")
    hits: dict[str, int] = {}
    with _timed(context, stage):
        for rule in registry.selected(stage, context):
            context.current_rule = rule.id
            count = applier(rule, target)
            if count:
                context.hits[rule.id] += count
            context.finish(rule)
            hits[rule.id] = count
    return hits


def _apply_fx(rule: Rule, target: Any) -> int:
    from hfexport.rewrites.kinds.fx import apply_fx_rule

    return apply_fx_rule(rule, target)


# One applier per transform stage; later stages (aten, onnx, executorch, openvino) add theirs here.
_APPLIERS = {"fx": _apply_fx}


def register_applier(stage: str, applier: Any) -> None:
    """Let a lowering add the applier of its own stage when its packages are imported."""
    if stage not in STAGES:
        raise ValueError(f"unknown stage {stage!r}")
    _APPLIERS[stage] = applier


_DEFAULT: RuleRegistry | None = None
# A registry that stands in for the default one in this context (the example harness checks a rule that is
# not registered, or a changed copy of one, through the real exporters).
_OVERRIDE: ContextVar[RuleRegistry | None] = ContextVar("hfexport_registry_override", default=None)


@contextmanager
def using_registry(registry: RuleRegistry) -> Iterator[None]:
    """Make `default_registry()` return `registry` for the exports started in this block (this context only)."""
    token = _OVERRIDE.set(registry)
    try:
        yield
    finally:
        _OVERRIDE.reset(token)


def default_registry() -> RuleRegistry:
    """The process-wide registry, filled on first use from the ordered lists in `registry.py`."""
    global _DEFAULT
    override = _OVERRIDE.get()
    if override is not None:
        return override
    if _DEFAULT is None:
        from hfexport.rewrites.registry import build_registry

        _DEFAULT = build_registry()
    return _DEFAULT
