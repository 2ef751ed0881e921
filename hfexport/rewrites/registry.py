"""Explicit registration: each stage package exposes `RULES`, an ordered list; this module loads them.

Order matters within a stage (a later rule sees what an earlier one produced) and is reviewed in diffs.
Adding a stage means adding its package here.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.rule import STAGES, Rule, RuleDefinitionError, RuleSelection

STAGE_PACKAGES: dict[str, str] = {
    "patch": "hfexport.rewrites.rules.patch",
    "fx": "hfexport.rewrites.rules.fx",
    "aten": "hfexport.rewrites.rules.aten",
    "onnx": "hfexport.rewrites.rules.onnx",
    "executorch": "hfexport.rewrites.rules.executorch",
    "openvino": "hfexport.rewrites.rules.openvino",
}


class RuleRegistry:
    """Rules by stage, in registration order (the order they run in)."""

    def __init__(self) -> None:
        self._by_stage: dict[str, list[Rule]] = {stage: [] for stage in STAGES}
        self._by_id: dict[str, Rule] = {}
        self._aliases: dict[str, str] = {}  # former id -> the id of the rule that took it over

    def register(self, rule: Rule) -> Rule:
        if not isinstance(rule, Rule):
            raise RuleDefinitionError(f"not a rule: {rule!r}")
        if rule.id in self._by_id or rule.id in self._aliases:
            raise RuleDefinitionError(f"duplicate rule id {rule.id!r}")
        for alias in rule.meta.aliases:
            if alias in self._by_id or alias in self._aliases:
                raise RuleDefinitionError(f"rule {rule.id}: alias {alias!r} is already a rule id or alias")
        examples = rule.meta.examples
        if not any(isinstance(e, Match) for e in examples) or not any(isinstance(e, NoMatch) for e in examples):
            raise RuleDefinitionError(f"rule {rule.id} needs at least one Match and one NoMatch example")
        self._by_stage[rule.stage].append(rule)
        self._by_id[rule.id] = rule
        self._aliases.update(dict.fromkeys(rule.meta.aliases, rule.id))
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
        """The rule of `rule_id`, or of the rule that took over `rule_id` as a former id (an alias)."""
        try:
            return self._by_id[self._aliases.get(rule_id, rule_id)]
        except KeyError:
            raise KeyError(f"no rule {rule_id!r}; `hfexport rules list` shows the registered ids") from None

    def ids(self) -> list[str]:
        return list(self._by_id)

    def aliases(self) -> dict[str, str]:
        """Former rule ids and the id of the rule each one selects now."""
        return dict(self._aliases)

    def validate_selection(self, selection: RuleSelection) -> None:
        unknown = selection.unknown_patterns([*self.ids(), *self._aliases])
        if unknown:
            raise ValueError(
                f"rule selection names no registered rule: {unknown}; use an id or an id prefix such as "
                "'fx/' or 'patch/sdpa' (`hfexport rules list` shows them)"
            )

    def plan(self, selection: RuleSelection, backend: str | None = None) -> dict[str, str | None]:
        """Rule id -> None when it runs, else why not; requirements are honoured in both directions.

        A selected rule pulls in the rules it `requires` (unless the selection disables one of them, which
        drops the dependent too), so `--disable`/ablation never runs a rule without what it needs. For an export to
        `backend`, a requirement that is not for that backend is none (a rule of several backends may need another
        rule on one of them only).
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
                    if backend is not None and not self._by_id[required].applies_to(backend):
                        continue
                    if selection.disables(self._by_id[required].meta) or verdict[required].startswith("requires"):
                        verdict[rule_id] = f"requires {required}, which is not running ({verdict[required]})"
                    else:
                        verdict[required] = None  # pulled in by its dependent
                    changed = True
        return verdict

    def selected(self, stage: str, context: Any) -> list[Rule]:
        """The rules of `stage` that run for this context; the others are recorded as skipped."""
        plan = self.plan(context.selection, context.backend)
        chosen = []
        for rule in self._by_stage[stage]:
            if not rule.applies_to(context.backend):
                context.skip(rule, "other-backend", f"only for {', '.join(rule.meta.backends)}")
            elif plan[rule.id] is not None:
                context.skip(rule, "disabled", plan[rule.id])
            else:
                chosen.append(rule)
        return chosen


def build_registry() -> RuleRegistry:
    registry = RuleRegistry()
    for stage, package in STAGE_PACKAGES.items():
        for rule in importlib.import_module(package).RULES:
            if rule.stage != stage:
                raise ValueError(f"{package} lists {rule.id}, which belongs to stage {rule.stage!r}")
            registry.register(rule)
    registry.check_requirements()
    return registry


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
    """The process-wide registry, filled on first use from the ordered `RULES` lists of the stage packages."""
    global _DEFAULT
    override = _OVERRIDE.get()
    if override is not None:
        return override
    if _DEFAULT is None:
        _DEFAULT = build_registry()
    return _DEFAULT
