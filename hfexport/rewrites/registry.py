"""Explicit registration: each stage package exposes `RULES`, an ordered list; this module loads them.

Order matters within a stage (a later rule sees what an earlier one produced) and is reviewed in diffs.
Adding a stage means adding its package here. Rules from outside hfexport join through `register_rules(module)`
(or the HFEXPORT_RULES names, read when the default registry is built), after hfexport's own rules of their stage,
checked as hfexport's own are (`RuleRegistry.register_module`).
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from types import ModuleType
from typing import Any

from hfexport.rewrites import external
from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.rule import STAGES, Rule, RuleDefinitionError, RuleOrigin, RuleSelection

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
        self._modules: dict[str, RuleOrigin] = {}  # modules of rules from outside hfexport, registered so far

    def register(self, rule: Rule) -> Rule:
        if not isinstance(rule, Rule):
            raise RuleDefinitionError(f"not a rule: {rule!r}")
        if rule.id in self._by_id or rule.id in self._aliases:
            raise RuleDefinitionError(f"duplicate rule id {rule.id!r}: {self._holder(rule.id)}")
        for alias in rule.meta.aliases:
            if alias in self._by_id or alias in self._aliases:
                raise RuleDefinitionError(f"rule {rule.id}: alias {alias!r} is already taken: {self._holder(alias)}")
        examples = rule.meta.examples
        if not any(isinstance(e, Match) for e in examples) or not any(isinstance(e, NoMatch) for e in examples):
            raise RuleDefinitionError(f"rule {rule.id} needs at least one Match and one NoMatch example")
        self._by_stage[rule.stage].append(rule)
        self._by_id[rule.id] = rule
        self._aliases.update(dict.fromkeys(rule.meta.aliases, rule.id))
        return rule

    def _holder(self, rule_id: str) -> str:
        """Who has `rule_id` already, in words (for a refused registration)."""
        if rule_id in self._aliases:
            owner = self._by_id[self._aliases[rule_id]]
            return f"it is a former id of {owner.id} ({owner.origin_name}); pick another name"
        return f"{self._by_id[rule_id].origin_name} has a rule of this id; pick another name"

    def register_module(self, rules: list[Rule], origin: RuleOrigin) -> None:
        """Register the rules of a module from outside hfexport, all or none: each is checked as hfexport's own
        are (two example kinds, an id and former ids no other rule has, requirements that are registered), and
        joins the end of its stage. Raises `RuleDefinitionError` naming the module."""
        trial = RuleRegistry()
        try:
            for rule in rules:
                if rule.origin is not None and rule.origin.module != origin.module:
                    raise RuleDefinitionError(f"rule {rule.id} is listed by {rule.origin.module} already")
            for rule in (*self.rules(), *rules):
                trial.register(rule)
            trial.check_requirements()
        except RuleDefinitionError as exc:
            raise RuleDefinitionError(f"{origin.module}: {exc}") from None
        for rule in rules:
            self.register(rule)
            rule.origin = origin
        self._modules[origin.module] = origin

    def modules(self) -> dict[str, RuleOrigin]:
        """The modules of rules from outside hfexport registered here, by module name."""
        return dict(self._modules)

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


def register_rules(module: str | ModuleType, registry: RuleRegistry | None = None) -> list[Rule]:
    """Register the rules of a module from outside hfexport (default: in the process-wide registry) and return them.

    `module` is a module, a module name, or the name of an installed `hfexport.rules` entry point. The module lists
    its rules, in order, as `RULES`; rule `<stage>/<name>` is the object `<name>` (dashes as underscores) in the
    module or in its submodule `<name>` (`load_rules(__name__, [ids])` builds such a list). Each rule must pass the
    checks hfexport's own pass, and take an id no other rule has (hfexport's own ids included): a refused module
    registers nothing and raises `RuleDefinitionError` saying why. Registering a module again returns its rules.
    """
    registry = registry if registry is not None else default_registry()
    origin = external.resolve(module) if isinstance(module, str) else external.origin_of(module)
    if origin.module in registry.modules():
        return [r for r in registry.rules() if r.origin is not None and r.origin.module == origin.module]
    imported = module if isinstance(module, ModuleType) else external.import_rules_module(origin)
    rules = external.listed_rules(imported, known=registry.rules())
    registry.register_module(rules, origin)
    return rules


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
    """The process-wide registry, filled on first use from the ordered `RULES` lists of the stage packages, then
    the modules HFEXPORT_RULES names (rules from outside hfexport, in that order)."""
    global _DEFAULT
    override = _OVERRIDE.get()
    if override is not None:
        return override
    if _DEFAULT is None:
        registry = build_registry()
        for name in external.requested():
            try:
                register_rules(name, registry)
            except RuleDefinitionError as exc:
                raise RuleDefinitionError(f"{external.ENVIRONMENT_VARIABLE} names {name!r}: {exc}") from None
        _DEFAULT = registry
    return _DEFAULT
