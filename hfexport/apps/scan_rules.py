"""Which registered rules a scan's sites belong to: the causes the rules declare (`causes()`, each a pattern of
`hfexport.apps.scan_patterns` in the functions it names) and the rules that target a module, class or function or were
written for a model type (`RuleIndex`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hfexport.apps.scan_patterns import Site


@dataclass(frozen=True)
class Cause:
    """A pattern registered rules fix (their `RuleMeta.scan`, a `ScanCause`): sites of `kind` whose scope's last name
    matches `function` (a regex; one with a dot, `Class\\.method`, matches the whole scope: a method name alone such
    as `forward` says nothing).

    `rules` fix it where they target the site's module/class/function; tests/test_scan.py asserts that every
    such site of the installed transformers is targeted by one of them or is a documented known gap, so a copy
    of the code that a new transformers adds shows up as a failure rather than as a silent gap.
    """

    id: str
    kind: str
    function: str
    rules: tuple[str, ...]
    what: str

    def covers(self, site: Site) -> bool:
        import re

        # A pattern with an escaped dot (`Class\.method`) matches the whole scope, not its last name.
        name = site.scope if "\\." in self.function else site.scope.rsplit(".", 1)[-1]
        return site.kind == self.kind and re.fullmatch(self.function, name) is not None


def causes() -> tuple[Cause, ...]:
    """The causes the registered rules declare (`RuleMeta.scan`), in registry order; one cause declared by several
    rules (the same id, pattern and words) is one entry naming them all."""
    from hfexport.rewrites.engine import default_registry

    return _causes(default_registry())


@functools.cache
def _causes(registry: Any) -> tuple[Cause, ...]:
    found: dict[str, Cause] = {}
    for rule in registry.rules():
        for declared in rule.meta.scan:
            known = found.get(declared.id)
            if known is None:
                found[declared.id] = Cause(declared.id, declared.kind, declared.function, (rule.id,), declared.what)
            elif (known.kind, known.function, known.what) != (declared.kind, declared.function, declared.what):
                raise ValueError(f"cause {declared.id!r} of {rule.id} differs from the one {known.rules} declare")
            else:
                found[declared.id] = dataclasses.replace(known, rules=(*known.rules, rule.id))
    return tuple(found.values())


def causes_of(site: Site) -> list[Cause]:
    """The causes (`causes()`) that `site` is an instance of."""
    return [cause for cause in causes() if cause.covers(site)]


@dataclass
class RuleIndex:
    """Registered rules by the dotted paths they patch, and by the model types they were written for."""

    targets: dict[str, list[str]] = field(default_factory=dict)  # dotted target -> rule ids
    model_types: dict[str, list[str]] = field(default_factory=dict)  # model_type -> rule ids
    # Rules whose target is a predicate over modules: (site kind, covers(module, scope)) -> rule id. `covers`
    # says whether the rule binds to the function at `module.scope` (it imports the module), so it is asked
    # only about sites of the kind the rule fixes.
    predicates: dict[tuple[str, Callable[[str, str], bool]], list[str]] = field(default_factory=dict)

    @classmethod
    def from_registry(cls) -> RuleIndex:
        from hfexport.rewrites.engine import default_registry

        index = cls()
        for rule in default_registry().rules():
            target = getattr(rule, "target", None)
            for t in (target,) if isinstance(target, str) else (target if isinstance(target, tuple) else ()):
                if t:
                    index.targets.setdefault(t, []).append(rule.id)
            covers, kind = getattr(target, "covers", None), getattr(target, "scan_kind", None)
            if callable(target) and callable(covers) and isinstance(kind, str):
                index.predicates.setdefault((kind, covers), []).append(rule.id)
            for model_type in rule.meta.models:
                index.model_types.setdefault(model_type, []).append(rule.id)
        return index

    def rules_for(self, module: str, scope: str, kind: str | None = None) -> tuple[str, ...]:
        """Rules whose target is `module.scope`, an enclosing class of it, or a function it is in; and, for a
        site of `kind`, the predicate rules of that kind that bind to the function."""
        found: list[str] = []
        qualified = f"{module}.{scope}" if module else scope
        for target, ids in self.targets.items():
            if qualified == target or qualified.startswith(target + ".") or target.startswith(qualified + "."):
                found += [i for i in ids if i not in found]
        for (rule_kind, covers), ids in self.predicates.items():
            if kind == rule_kind and covers(module, scope):
                found += [i for i in ids if i not in found]
        return tuple(found)

    def rules_for_model(self, model_type: str) -> list[str]:
        return list(self.model_types.get(model_type, []))
