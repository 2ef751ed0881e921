"""The rule catalogue's facts about one rule, read from the rule and its source: where it is defined
(`rule_location`), whether its `expires` requirement is met (`expiry_status`), what it targets (`rule_target`), the
source of its body (`rule_sources`) and, for a model patch, the diff against the code it replaces (`rule_diff`).
They back `hfexport rules show`, the sweep's expired rules and the generated catalogue (docs/rules.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfexport.rewrites.rule import Rule, RuleMeta


def expiry_status(meta: RuleMeta) -> tuple[bool, str]:
    """(expired, detail): whether the installed package satisfies the rule's `expires` requirement."""
    if not meta.expires:
        return False, ""
    from packaging.requirements import Requirement
    from packaging.version import Version

    from hfexport.core.versions import installed_version

    requirement = Requirement(meta.expires)
    installed = installed_version(requirement.name)
    if installed is None:
        return False, f"{requirement.name} is not installed"
    met = requirement.specifier.contains(Version(Version(installed).public), prereleases=True)
    verb = "satisfies" if met else "does not satisfy yet"
    return met, f"{requirement.name} {installed} {verb} {meta.expires}"


@dataclass(frozen=True)
class RuleLocation:
    """Where a rule is defined: `path` (relative to the directory holding the `hfexport` package, i.e. the
    repository root of a checkout) and the 1-based `line` of `<name> = ...`."""

    module: str
    attribute: str
    path: str
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line}"


def rule_module_name(rule_id: str) -> tuple[str, str]:
    """(module, attribute) that must define `rule_id`: `hfexport.rewrites.rules.<stage>.<name>`, `<name>`."""
    from hfexport.rewrites.rule import module_name

    attribute = module_name(rule_id)
    return f"hfexport.rewrites.rules.{rule_id.split('/', 1)[0]}.{attribute}", attribute


def rule_location(rule: Rule) -> RuleLocation | None:
    """The file and line that define `rule` by the naming convention; None when the convention is broken
    (tests/rewrites/test_rule_metadata.py fails on that for every registered rule)."""
    import importlib
    import re

    module_name, attribute = rule_module_name(rule.id)
    # A rule from outside hfexport is `<name>` in the module that lists it or in that module's submodule `<name>`.
    homes = [module_name] if rule.origin is None else [f"{rule.origin.module}.{attribute}", rule.origin.module]
    module = None
    for name in homes:
        with contextlib.suppress(ImportError):
            candidate = importlib.import_module(name)
            if getattr(candidate, attribute, None) is rule:
                module_name, module = name, candidate
                break
    if module is None or not getattr(module, "__file__", None):
        return None
    file = Path(module.__file__).resolve()
    root = Path(__file__).resolve().parents[2]  # the folder that holds the hfexport package
    path = file.relative_to(root).as_posix() if file.is_relative_to(root) else str(file)
    definition = re.compile(rf"^{re.escape(attribute)}\s*(?::[^=]*)?=")
    lines = file.read_text().splitlines()
    line = next((i for i, text in enumerate(lines, 1) if definition.match(text)), 0)
    return RuleLocation(module_name, attribute, path, line) if line else None


def _source(obj: Any) -> str | None:
    target = inspect.unwrap(obj) if callable(obj) else obj
    try:
        return textwrap.dedent(inspect.getsource(target))
    except (OSError, TypeError):
        return None


def _original(target: str) -> tuple[str, Any] | None:
    from hfexport.rewrites.kinds.patch import resolve

    resolved = resolve(target)
    if isinstance(resolved, str):
        return None
    owner, name = resolved
    return target, inspect.getattr_static(owner, name)


def rule_diff(rule: Rule) -> str | None:
    """For a model patch: a unified diff of the patched function's source against the replacement's (one per
    variant of a rule with a replacement per backend, each headed by its backends).

    None when there is nothing to compare (a predicate target, a target missing from the installed packages).
    """
    before: tuple[str, Any] | None = None
    target = getattr(rule, "target", None)
    if type(rule).__name__ in ("MethodPatch", "ModuleFunctionPatch"):
        named = target if isinstance(target, tuple) else (target,)  # a predicate target names no source to diff
        targets = tuple(t for t in named if isinstance(t, str) and t)
        before = next((found for t in targets if (found := _original(t)) is not None), None)
    old = _source(before[1]) if before is not None else None
    if before is None or old is None:
        return None
    diffs = []
    for backends, after in _variants_of(rule, getattr(rule, "replacement", None)):
        new = _source(after) if after is not None else None
        if new is None:
            continue
        name = getattr(after, "__qualname__", "replacement")
        to = f"{name} ({', '.join(backends)})" if backends else name
        diffs.append(
            "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), fromfile=before[0], tofile=to))
        )
    return "".join(diffs) or None


def _variants_of(rule: Rule, value: Any) -> list[tuple[tuple[str, ...], Any]]:
    """`[((), value)]`, or for a `PerBackend` value each distinct value with the backends that get it."""
    from hfexport.rewrites.rule import PerBackend

    if not isinstance(value, PerBackend):
        return [((), value)]
    return [(variant, value.get(variant[0])) for variant in rule.variants()]


def rule_sources(rule: Rule) -> dict[str, str]:
    """The source of each callable field of the rule's body (replacement, pattern, transform, ...); a field with a
    value per backend gives one source per variant (`"replacement (dynamo, onnx)"`)."""
    sources = {}
    for f in dataclasses.fields(rule):
        if f.name in ("meta", "phase"):
            continue
        for backends, value in _variants_of(rule, getattr(rule, f.name)):
            if not callable(value) or isinstance(value, type):
                continue
            text = _source(value)
            if text is not None:
                sources[f"{f.name} ({', '.join(backends)})" if backends else f.name] = text
    return sources


def rule_target(rule: Rule) -> str:
    """What the rule patches or matches, in words (for listings)."""
    target = getattr(rule, "target", None)
    if isinstance(target, str) and target:
        return target
    if isinstance(target, tuple):
        return ", ".join(target)
    if callable(target):
        return f"modules matching {getattr(target, '__name__', 'a predicate')}.{getattr(rule, 'method', '')}"
    function = getattr(rule, "function", None)
    if function is not None:
        return f"torch function {getattr(function, '__name__', function)}"
    return ""
