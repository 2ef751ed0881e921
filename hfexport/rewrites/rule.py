"""The rule record every rewrite shares, and rule selection.

A rule is metadata plus a stage-specific body. The metadata is validated at construction so a malformed
rule fails at import, not halfway through an export.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from hfexport.backends.registry import backends as _registered
from hfexport.backends.registry import find
from hfexport.formats import FORMATS
from hfexport.rewrites.upstream import UPSTREAM_FORMS, UpstreamRef, parse_upstream

if TYPE_CHECKING:
    from hfexport.rewrites.examples import Example

# Pipeline order. Adding a stage: append it here and to PHASES, give a rule kind its name in `stages` (and an
# applier in engine.py), and list its rule package in registry.py.
STAGES: tuple[str, ...] = ("patch", "fx", "aten", "onnx", "executorch", "openvino")
# The phases of each stage, in the order a lowering reaches them; each rule kind runs in one of its stage's
# phases (`Rule.phase`), and the lowering names the phase it is at: `engine.apply(stage, target, context, phase=)`.
PHASES: dict[str, tuple[str, ...]] = {
    "patch": ("trace",),  # installed on the live model around the trace
    "fx": ("program",),  # the captured ExportedProgram
    "aten": ("translation",),  # torch.onnx's translation table
    # the ONNX IR: fixes right after translation, fusions after the optimizer, rewrites of what a quantizer wrote
    "onnx": ("fix", "fusion", "quantized"),
    "executorch": ("program",),  # the program before to_edge
    "openvino": ("program", "model"),  # the program before convert_model, then the converted model
}
# `RuleMeta.backends`, `PerBackend` and `Match(backends=)` may name every registered backend's format (`FORMATS`).
# A rule's backends by default: every backend that runs rules of its own. A backend that compiles another's program
# (`Backend.rules`: AOTInductor runs the Dynamo rules) runs the rules of that one too, and a rule may name it alone.
BACKENDS: tuple[str, ...] = tuple(b.name for b in _registered() if b.rules == b.name)


def rules_of(backend: str) -> str:
    """The backend whose rules an export to `backend` runs besides its own (`Backend.rules`), or `backend` itself."""
    found = find(backend)
    return found.rules if found is not None else backend


RuleKind = Literal["fix", "optimization"]

_ID_RE = re.compile(r"^(?P<stage>[a-z]+)/[a-z0-9]+(?:[-.][a-z0-9]+)*$")


class RuleDefinitionError(ValueError):
    """A rule violates the rule model (bad id, missing examples, unknown backend, ...)."""


@dataclass(frozen=True)
class ScanCause:
    """A pattern of Python source that this rule fixes, as `hfexport scan` finds it: sites of `kind` (a scan
    pattern, `hfexport.apps.scan_patterns.KINDS`) whose scope's last name matches `function` (a regex; one with an
    escaped dot, `Class\\.method`, matches the whole scope). `id` names the cause; `what` says what goes wrong, in a
    line.

    `hfexport.apps.scan_rules.causes()` is the table of every registered rule's causes; tests/test_scan.py asserts that
    each site of a cause in the installed transformers is targeted by a rule of it or is a documented known gap.
    """

    id: str
    kind: str
    function: str
    what: str


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
    # Where the need of a fix is shown when the example harness cannot show it (the need is a save, a second
    # program, memory, or a crash of the process): the test that shows it, and why there. The harness's check
    # that the fix is needed is skipped with this as its reason.
    needed: str = ""
    # A backend cannot run a plain model without this rule (e.g. OpenVINO's CPU plugin refuses a constant input
    # of dynamic rank): the example harness keeps it on in every example export of the rule's backends.
    baseline: bool = False
    # The patterns of Python source this rule fixes (`hfexport scan` reports their sites with the rule).
    scan: tuple[ScanCause, ...] = ()
    # Former ids of this rule (rules merged into it, or renamed): a rule selection that names one selects this
    # rule, so `--disable <former id>` keeps working.
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        match = _ID_RE.match(self.id)
        if not match or match["stage"] not in STAGES:
            raise RuleDefinitionError(
                f"rule id {self.id!r} must look like '<stage>/<kebab-case-name>' with stage in {STAGES}"
            )
        if not self.why.strip():
            raise RuleDefinitionError(f"rule {self.id}: `why` must say what it fixes or buys")
        if self.kind not in ("fix", "optimization"):
            raise RuleDefinitionError(f"rule {self.id}: kind must be 'fix' or 'optimization'")
        if self.kind == "fix" and not self.upstream.strip():
            raise RuleDefinitionError(f"rule {self.id}: a fix needs `upstream`: {UPSTREAM_FORMS}")
        if self.upstream.strip():
            try:
                parse_upstream(self.upstream)
            except ValueError as exc:
                raise RuleDefinitionError(f"rule {self.id}: {exc}") from None
        unknown = set(self.backends) - set(FORMATS)
        if unknown or not self.backends:
            raise RuleDefinitionError(f"rule {self.id}: backends {sorted(unknown)} not in {FORMATS}")
        for name in ("requires", "scan", "aliases", "examples"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for required in self.requires:
            if not _ID_RE.match(required) or required == self.id:
                raise RuleDefinitionError(f"rule {self.id}: `requires` names {required!r}, not another rule id")
        for alias in self.aliases:
            alias_match = _ID_RE.match(alias)
            if not alias_match or alias_match["stage"] != self.stage or alias == self.id:
                raise RuleDefinitionError(f"rule {self.id}: alias {alias!r} must be another id of stage {self.stage!r}")
        if self.needed and self.kind != "fix":
            raise RuleDefinitionError(f"rule {self.id}: `needed` is for a fix (an optimization is judged by its graph)")
        self._check_examples()
        if self.expires is not None:
            from packaging.requirements import InvalidRequirement, Requirement

            try:
                requirement = Requirement(self.expires)
            except InvalidRequirement as exc:
                message = f"rule {self.id}: `expires` {self.expires!r} is not a requirement: {exc}"
                raise RuleDefinitionError(message) from None
            if not requirement.specifier:
                # A bare package name would be met by any installed version: the rule would always be expired.
                raise RuleDefinitionError(
                    f"rule {self.id}: `expires` {self.expires!r} needs a version bound, e.g. '{requirement.name}>1.2.3'"
                )

    def _check_examples(self) -> None:
        for index, example in enumerate(self.examples):
            what = f"rule {self.id}: example {index} ({example.description!r})"
            backends = set(getattr(example, "backends", ()) or self.backends)
            if not backends <= set(self.backends):
                raise RuleDefinitionError(f"{what}: backends {sorted(backends)} not all in {self.backends}")
            failing = {backend for backend, _ in getattr(example, "known_failure", ())}
            if not failing <= backends:
                raise RuleDefinitionError(f"{what}: known_failure names {sorted(failing - backends)}, not its backends")

    @property
    def stage(self) -> str:
        return self.id.split("/", 1)[0]

    @property
    def name(self) -> str:
        """The id without its stage: `rules/<stage>/<name with underscores>.py` defines the rule."""
        return self.id.split("/", 1)[1]

    @property
    def upstream_ref(self) -> UpstreamRef | None:
        """`upstream` parsed; None for an optimization that names no upstream."""
        return parse_upstream(self.upstream) if self.upstream.strip() else None


@dataclass(frozen=True)
class RuleSelection:
    """Which rules run: all default-on rules, plus `enable`, minus `disable` (ids or id prefixes).

    The most specific (longest) matching pattern decides; on a tie `disable` wins, so
    `RuleSelection(enable=("fx/",), disable=("fx/drop-assert",))` keeps every FX rule but one. A pattern that names a
    rule's former id (`RuleMeta.aliases`, e.g. a per-backend rule merged into its family's) selects that rule.
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

    def with_enabled(self, patterns: tuple[str, ...] | list[str]) -> RuleSelection:
        """This selection with opt-in `patterns` enabled too, unless a pattern of its own disables them."""
        new = tuple(p for p in patterns if p not in self.enable and not any(_matches(d, p) for d in self.disable))
        return RuleSelection((*self.enable, *new), self.disable, self.reasons)

    def reason_for(self, meta: RuleMeta) -> str:
        """Why `meta` does not run under this selection (the reason of the pattern that disabled it)."""
        notes = dict(self.reasons)
        matching = [p for p in self.disable if _names(p, meta)]
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
                if _names(pattern, meta) and longer:
                    best_len, verdict = len(pattern), on
        return verdict

    def disables(self, meta: RuleMeta) -> bool:
        """Whether a `disable` pattern decides against `meta` (not merely its default being off)."""
        return not self.is_enabled(meta) and any(_names(p, meta) for p in self.disable)

    def unknown_patterns(self, rule_ids: list[str]) -> list[str]:
        """Patterns that match no registered rule id or alias (almost always a typo)."""
        return [p for p in (*self.enable, *self.disable) if not any(_matches(p, i) for i in rule_ids)]

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"enable": list(self.enable), "disable": list(self.disable)}
        if self.reasons:
            data["reasons"] = dict(self.reasons)
        return data


def _names(pattern: str, meta: RuleMeta) -> bool:
    """Whether `pattern` selects the rule of `meta`, by its id or by one of its former ids (`aliases`)."""
    return any(_matches(pattern, rule_id) for rule_id in (meta.id, *meta.aliases))


def _matches(pattern: str, rule_id: str) -> bool:
    # A prefix must end at an id boundary: "fx" selects "fx/..." and "patch/sdpa" selects
    # "patch/sdpa-math", but "patch/sd" selects nothing.
    if rule_id == pattern:
        return True
    if not rule_id.startswith(pattern):
        return False
    return pattern.endswith(("/", "-")) or rule_id[len(pattern)] in "/-"


class PerBackend:
    """A part of a rule's body that differs per backend: `replacement=PerBackend(dynamo=scan, onnx=detached_scan)`.

    One cause fixed one way per backend is one rule (one file, one `why`), not one rule per backend. Every backend
    of the rule must have its value; backends that share a value are one variant of the rule (`Rule.variants()`).
    """

    def __init__(self, **values: Any) -> None:
        unknown = set(values) - set(FORMATS)
        if unknown or not values:
            raise RuleDefinitionError(f"PerBackend names {sorted(unknown) or 'no backend'}; backends are {FORMATS}")
        self._values = dict(values)

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(b for b in FORMATS if b in self._values)

    def get(self, backend: str) -> Any:
        """The value for `backend`, else for the backend whose rules it runs (KeyError for a backend the rule is not
        for)."""
        return self._values[backend] if backend in self._values else self._values[rules_of(backend)]

    def __repr__(self) -> str:
        return f"PerBackend({', '.join(f'{b}={v!r}' for b, v in self._values.items())})"


def for_backend(value: Any, backend: str) -> Any:
    """`value` itself, or a `PerBackend` value's value for `backend`."""
    return value.get(backend) if isinstance(value, PerBackend) else value


@dataclass(frozen=True)
class RuleOrigin:
    """Where a rule from outside hfexport comes from: the module that lists it in `RULES` (`register_rules`), and the
    installed distribution that declares that module as an `hfexport.rules` entry point, when one does. A rule of
    hfexport itself has no origin (`Rule.origin` is None)."""

    module: str
    entry_point: str = ""  # the entry point's name, what `--rules` and HFEXPORT_RULES may name instead of the module
    distribution: str = ""
    version: str = ""

    def __str__(self) -> str:
        return f"{self.module} ({self.distribution} {self.version})" if self.distribution else self.module


BUILTIN_ORIGIN = "hfexport"  # how listings name the origin of hfexport's own rules


@dataclass
class Applied:
    """What applying one rule to its target did: the sites it changed (`hits`), why it left matched sites alone
    (`declined`: reason -> count), what it hands to the lowering (`outputs`, e.g. an edge pass; the lowering reads
    them from the stage's result), or why it does not apply to this target at all (`not_applicable`)."""

    hits: int = 0
    declined: Counter[str] = field(default_factory=Counter)
    outputs: tuple[Any, ...] = ()
    not_applicable: str = ""


@dataclass
class Rule:
    """Base of every rule kind. A kind names the `stages` its rules may be in (a rule's id names its stage) and
    the phase of the stage they run in (`phase`, one of `PHASES[stage]`), and adds its body fields."""

    meta: RuleMeta
    stages: ClassVar[tuple[str, ...]] = ()
    phase: str = field(init=False, default="")
    # Set when the rule is registered from a module outside hfexport (`register_rules`); None for hfexport's own.
    origin: RuleOrigin | None = field(init=False, default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.meta.stage not in self.stages:
            raise RuleDefinitionError(
                f"rule {self.meta.id}: a {type(self).__name__} is a rule of stage {' or '.join(self.stages)}, "
                f"not {self.meta.stage!r}"
            )
        if self.phase not in PHASES[self.stage]:
            raise RuleDefinitionError(
                f"rule {self.meta.id}: phase {self.phase!r} is not a phase of stage {self.stage!r} {PHASES[self.stage]}"
            )
        for name, value in self._per_backend().items():
            if set(value.backends) != set(self.meta.backends):
                has, wants = value.backends, self.meta.backends
                raise RuleDefinitionError(f"rule {self.meta.id}: `{name}` is given for {has}, the rule is for {wants}")

    def _per_backend(self) -> dict[str, PerBackend]:
        return {f.name: v for f in fields(self) if isinstance(v := getattr(self, f.name), PerBackend)}

    def variants(self) -> tuple[tuple[str, ...], ...]:
        """The rule's backends grouped by the body they get (in `meta.backends` order): one group for a rule whose
        body is the same on every backend, one per distinct value of its `PerBackend` fields otherwise."""
        per_backend = self._per_backend().values()
        groups: dict[tuple[int, ...], list[str]] = {}
        for backend in self.meta.backends:
            key = tuple(id(value.get(backend)) for value in per_backend)
            groups.setdefault(key, []).append(backend)
        return tuple(tuple(group) for group in groups.values())

    @property
    def id(self) -> str:
        return self.meta.id

    @property
    def stage(self) -> str:
        return self.meta.stage

    @property
    def origin_name(self) -> str:
        """Where the rule comes from, for listings: `hfexport`, or the module (and distribution) that registered it."""
        return BUILTIN_ORIGIN if self.origin is None else str(self.origin)

    def applies_to(self, backend: str) -> bool:
        """Whether an export to `backend` runs the rule: it names `backend`, or the backend whose rules `backend`
        runs (`Backend.rules`)."""
        return backend in self.meta.backends or rules_of(backend) in self.meta.backends


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
