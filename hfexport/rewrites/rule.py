"""The rule record every rewrite shares, and rule selection.

A rule is metadata plus a stage-specific body. The metadata is validated at construction so a malformed
rule fails at import, not halfway through an export.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from hfexport.rewrites.examples import Example

# Pipeline order. Adding a stage: append it here, give it a rule class with `stage = "<name>"` and an
# applier in engine.py, and list its rule package in registry.py.
STAGES: tuple[str, ...] = ("patch", "fx", "aten", "onnx", "executorch", "openvino")
BACKENDS: tuple[str, ...] = ("dynamo", "onnx", "executorch", "openvino")
RuleKind = Literal["fix", "optimization"]

_ID_RE = re.compile(r"^(?P<stage>[a-z]+)/[a-z0-9]+(?:[-.][a-z0-9]+)*$")


class RuleDefinitionError(ValueError):
    """A rule violates the rule model (bad id, missing examples, unknown backend, ...)."""


@dataclass(frozen=True)
class RuleMeta:
    """Metadata shared by every rule kind (see DESIGN.md, "The rule model")."""

    id: str
    why: str
    upstream: str
    backends: tuple[str, ...] = BACKENDS
    models: tuple[str, ...] = ()
    kind: RuleKind = "fix"
    expires: str | None = None
    examples: tuple[Example, ...] = ()
    # Opt-in rules (default False) run only when `RuleSelection.enable` names them.
    enabled_by_default: bool = True
    # Ids of rules this one is only correct or useful after (in this stage or an earlier one). The engine runs
    # them whenever this rule runs, and drops this rule when the selection disables one of them.
    requires: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        match = _ID_RE.match(self.id)
        if not match or match["stage"] not in STAGES:
            raise RuleDefinitionError(
                f"rule id {self.id!r} must look like '<stage>/<kebab-case-name>' with stage in {STAGES}"
            )
        if not self.why.strip():
            raise RuleDefinitionError(f"rule {self.id}: `why` must say what it fixes or buys")
        if self.kind == "fix" and not self.upstream.strip():
            raise RuleDefinitionError(f"rule {self.id}: a fix needs `upstream` (issue, PR or package version)")
        if self.kind not in ("fix", "optimization"):
            raise RuleDefinitionError(f"rule {self.id}: kind must be 'fix' or 'optimization'")
        unknown = set(self.backends) - set(BACKENDS)
        if unknown or not self.backends:
            raise RuleDefinitionError(f"rule {self.id}: backends {sorted(unknown)} not in {BACKENDS}")
        object.__setattr__(self, "requires", tuple(self.requires))
        for required in self.requires:
            if not _ID_RE.match(required) or required == self.id:
                raise RuleDefinitionError(f"rule {self.id}: `requires` names {required!r}, not another rule id")
        if self.expires is not None:
            from packaging.requirements import Requirement

            Requirement(self.expires)  # raises on a malformed requirement

    @property
    def stage(self) -> str:
        return self.id.split("/", 1)[0]


@dataclass(frozen=True)
class RuleSelection:
    """Which rules run: all default-on rules, plus `enable`, minus `disable` (ids or id prefixes).

    The most specific (longest) matching pattern decides; on a tie `disable` wins, so
    `RuleSelection(enable=("fx/",), disable=("fx/drop-assert",))` keeps every FX rule but one.
    """

    enable: tuple[str, ...] = ()
    disable: tuple[str, ...] = ()
    # Why a `disable` pattern is there when the export added it, not the user (a quantizer's exclusions,
    # `OnnxConfig(fusions=None)`): `(pattern, reason)` pairs the report shows as each skipped rule's reason.
    reasons: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        # Accept lists from JSON or a single string by mistake, but store tuples (hashable, frozen).
        for name in ("enable", "disable"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = (value,)
            object.__setattr__(self, name, tuple(value))
        reasons = self.reasons.items() if isinstance(self.reasons, dict) else self.reasons
        object.__setattr__(self, "reasons", tuple((str(p), str(r)) for p, r in reasons))

    def with_disabled(self, patterns: tuple[str, ...] | list[str], reason: str) -> RuleSelection:
        """This selection with `patterns` disabled too, for `reason` (shown in the report)."""
        new = tuple(p for p in patterns if p not in self.disable)
        return RuleSelection(self.enable, (*self.disable, *new), (*self.reasons, *((p, reason) for p in new)))

    def reason_for(self, meta: RuleMeta) -> str:
        """Why `meta` does not run under this selection (the reason of the pattern that disabled it)."""
        notes = dict(self.reasons)
        matching = [p for p in self.disable if _matches(p, meta.id)]
        if matching:
            best = max(matching, key=len)
            if best in notes:
                return notes[best]
        return "disabled by the rule selection" if matching or meta.enabled_by_default else "opt-in rule, not enabled"

    def is_enabled(self, meta: RuleMeta) -> bool:
        best_len, verdict = -1, meta.enabled_by_default
        for patterns, on in ((self.enable, True), (self.disable, False)):
            for pattern in patterns:
                # Longer wins; at equal length disable (seen second) wins.
                longer = len(pattern) > best_len or (len(pattern) == best_len and not on)
                if _matches(pattern, meta.id) and longer:
                    best_len, verdict = len(pattern), on
        return verdict

    def disables(self, meta: RuleMeta) -> bool:
        """Whether a `disable` pattern decides against `meta` (not merely its default being off)."""
        return not self.is_enabled(meta) and any(_matches(p, meta.id) for p in self.disable)

    def unknown_patterns(self, rule_ids: list[str]) -> list[str]:
        """Patterns that match no registered rule (almost always a typo)."""
        return [p for p in (*self.enable, *self.disable) if not any(_matches(p, i) for i in rule_ids)]

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"enable": list(self.enable), "disable": list(self.disable)}
        if self.reasons:
            data["reasons"] = dict(self.reasons)
        return data


def _matches(pattern: str, rule_id: str) -> bool:
    # A prefix must end at an id boundary: "fx" selects "fx/..." and "patch/sdpa" selects
    # "patch/sdpa-math", but "patch/sd" selects nothing.
    if rule_id == pattern:
        return True
    if not rule_id.startswith(pattern):
        return False
    return pattern.endswith(("/", "-")) or rule_id[len(pattern)] in "/-"


@dataclass
class Rule:
    """Base of every rule kind. Subclasses set `stage` and add their body fields."""

    meta: RuleMeta
    stage: str = field(init=False, default="")

    def __post_init__(self) -> None:
        if self.meta.stage != self.stage:
            raise RuleDefinitionError(
                f"rule {self.meta.id}: id stage {self.meta.stage!r} does not match {type(self).__name__}"
            )

    @property
    def id(self) -> str:
        return self.meta.id

    def applies_to(self, backend: str) -> bool:
        return backend in self.meta.backends


def module_name(rule_id: str) -> str:
    """The module (under `hfexport.rewrites.rules.<stage>`) and object name of a rule: its id's name, snake-cased."""
    return rule_id.split("/", 1)[1].replace("-", "_").replace(".", "_")


def load_rules(package: str, ids: list[str]) -> list[Rule]:
    """The rules `ids` of a stage package, in this order: rule `<stage>/<name>` is `<name>` in `<package>.<name>`.

    Each stage package writes its ordered, commented list as ids; loading them here keeps the id, the file and
    the Python name one and the same (a rule defined anywhere else, or under another name, fails to load).
    """
    import importlib

    rules = []
    for rule_id in ids:
        name = module_name(rule_id)
        module = importlib.import_module(f"{package}.{name}")
        rule = getattr(module, name, None)
        if not isinstance(rule, Rule) or rule.id != rule_id:
            raise RuleDefinitionError(f"{package}.{name} must define the rule {rule_id!r} as `{name}`")
        rules.append(rule)
    return rules
