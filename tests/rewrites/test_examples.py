"""Every registered rule's examples run here, and the registry itself is checked.

A `Match` must fire and keep eager numerics; a `NoMatch` must fire zero times and change nothing.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest

from hfexport.rewrites.engine import default_registry
from hfexport.rewrites.examples import Match, NoMatch, check_example
from hfexport.rewrites.registry import STAGE_PACKAGES
from hfexport.rewrites.rule import _ID_RE, STAGES, Rule

REGISTRY = default_registry()
RULES = REGISTRY.rules()


def _example_params() -> list:
    params = []
    for rule in RULES:
        for i, example in enumerate(rule.meta.examples):
            kind = "match" if isinstance(example, Match) else "nomatch"
            params.append(pytest.param(rule, example, id=f"{rule.id}[{kind}{i}]"))
    return params


@pytest.mark.parametrize(("rule", "example"), _example_params())
def test_rule_example(rule: Rule, example: Match | NoMatch) -> None:
    hits = check_example(rule, example)
    if isinstance(example, Match):
        assert hits > 0
    else:
        assert hits == 0


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
