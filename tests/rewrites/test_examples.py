"""Every registered rule's examples run here, through the real exporters and runtimes; the registry is checked too.

`hfexport.testing.harness` does the work: a `Match` must fire and equal eager on each backend the rule is for
(dynamic where the example gives `other_inputs`); a `NoMatch` must run the rule, fire zero times and change
nothing; a fix must be needed (some Match fails or differs without it); an optimization must change the graph.

Tiers (the budget of the default tier): it checks each rule's first Match on the rule's first backend (a patch on
dynamo, a backend rule on its backend), and so for each variant of a rule with per-backend bodies; the first
NoMatch (which `hfexport rules test` checks by default), every other example and backend, an example marked
`slow`, and each fix's need, run under `-m slow`. What this file knows of a rule
comes from the rule: an example's `known_failure` is a strict expected failure here, a fix's `needed` skips its
need check with that reason.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest

from hfexport.backends import backend
from hfexport.rewrites.engine import default_registry
from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.registry import STAGE_PACKAGES
from hfexport.rewrites.rule import _ID_RE, STAGES, Rule
from hfexport.testing import harness

REGISTRY = default_registry()
RULES = REGISTRY.rules()


def _slow_elsewhere(check: harness.ExampleCheck) -> bool:
    """A rule of another stage checked on a backend that takes about a minute per lowering (ExecuTorch): the slow
    tier's. That backend's own rules keep their first Match here (no other backend can show them); another stage's
    variant for it (a patch's ExecuTorch body) is shown by the built-in models' ExecuTorch exports."""
    return bool(backend(check.backend).slow_lowering) and check.rule.stage != check.backend


def _example_params() -> list:
    params = []
    for check in harness.example_checks(RULES):
        # This suite's default tier holds each rule's first Match; the NoMatch checks `hfexport rules test` runs by
        # default run here in the slow tier (the test command's 20-minute budget).
        default = check.default_tier and isinstance(check.example, Match) and not _slow_elsewhere(check)
        marks = [] if default else [pytest.mark.slow]
        if check.known_failure is not None:
            marks.append(pytest.mark.xfail(reason=check.known_failure, strict=True))
        params.append(pytest.param(check, id=check.id, marks=marks))
    return params


@pytest.mark.parametrize("check", _example_params())
def test_rule_example(check: harness.ExampleCheck) -> None:
    hits = check.run()
    assert hits > 0 or isinstance(check.example, NoMatch)


def _fix_params() -> list:
    params = []
    for rule in RULES:
        if rule.meta.kind != "fix":
            continue
        # Slow: a fix stops being needed when a dependency is upgraded, which the slow tier is run for.
        marks = [pytest.mark.slow]
        if rule.meta.needed:
            marks.append(pytest.mark.skip(reason=rule.meta.needed))
        params.append(pytest.param(rule, id=rule.id, marks=marks))
    return params


@pytest.mark.parametrize("rule", _fix_params())
def test_fix_is_needed(rule: Rule) -> None:
    """Some Match example of the fix fails (raises, or differs from eager) with the rule disabled."""
    assert harness.check_fix_needed(rule).how


def test_registry_ids_are_unique_and_well_formed() -> None:
    ids = [rule.id for rule in RULES]
    assert len(ids) == len(set(ids))
    for rule in RULES:
        assert _ID_RE.match(rule.id) and rule.stage in STAGES, rule.id
        assert rule.meta.why.strip() and (rule.meta.upstream.strip() or rule.meta.kind == "optimization")


def test_every_rule_has_both_example_kinds() -> None:
    for rule in RULES:
        assert any(isinstance(e, Match) for e in rule.meta.examples), rule.id
        assert any(isinstance(e, NoMatch) for e in rule.meta.examples), rule.id


def _rules_defined_in(package_name: str) -> list[Rule]:
    package = importlib.import_module(package_name)
    found: list[Rule] = []
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{package_name}.{info.name}")
        found += [value for value in vars(module).values() if isinstance(value, Rule)]
    return found


@pytest.mark.parametrize("stage", sorted(STAGE_PACKAGES))
def test_every_rule_module_is_imported_and_every_rule_registered(stage: str) -> None:
    registered = {rule.id for rule in REGISTRY.rules(stage)}
    defined = {rule.id for rule in _rules_defined_in(STAGE_PACKAGES[stage])}
    assert defined <= registered, f"rules defined but missing from RULES: {sorted(defined - registered)}"


def test_there_are_patch_rules() -> None:
    assert REGISTRY.rules("patch")
