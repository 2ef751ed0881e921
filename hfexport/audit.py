"""Audit rewrite rules: what each did in one export, whether it has expired, and whether it is still needed.

`run_audit` exports a model once and lists every registered rule with its stage, kind, hits and status
(fired, no match, not applicable and why, disabled, other backend), plus whether its `expires`
requirement is met by the installed packages. With `ablate`, it re-exports once per fired rule with only
that rule disabled (`RuleSelection(disable=(id,))` added to the config's selection; the rules that require
it go with it, as the engine plans, and are named), runs the saved artifact in its own runtime against
eager, and calls a fix *needed* when the export then fails or no longer matches eager. An optimization
keeps numerics by design, so it is judged by the graph its runtime executes: node count and op histogram
with and without it ("needed for speed: N nodes fewer").

The inspection helpers at the bottom (`expiry_status`, `rule_diff`, `rule_sources`) back `hfexport rules
show` and the generated catalogue.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import inspect
import json
import tempfile
import textwrap
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hfexport.rewrites.rule import STAGES, Rule, RuleMeta, RuleSelection
from hfexport.timing import eta

# Which pipeline stages run for each format (the stages a rule of another backend would never reach).
FORMAT_STAGES: dict[str, tuple[str, ...]] = {
    "dynamo": ("patch", "fx"),
    "onnx": ("patch", "fx", "aten", "onnx"),
    "executorch": ("patch", "fx", "executorch"),
    "openvino": ("patch", "fx", "openvino"),
}
Progress = Callable[[str], None]


# Statuses of a rule that ran in the export: the audit's table shows these unless --all.
_RAN = ("fired", "no-match")


@dataclass
class GraphStats:
    """The size of what the runtime executes: node count and op histogram, and which graph was counted."""

    where: str
    nodes: int
    ops: dict[str, int] = field(default_factory=dict)


@dataclass
class Ablation:
    """One re-export with a single rule disabled (and the rules that require it, which go with it).

    A fix is judged by the export: needed when the export then fails or no longer matches eager. An
    optimization keeps the numerics by design, so it is judged by what it buys: the node count (and op
    histogram) of the graph the runtime executes, with the rule (`base_graph`) and without it (`graph`).
    """

    rule_id: str
    exported: bool
    error: str = ""
    max_abs_diff: dict[str, float] = field(default_factory=dict)
    matches: bool | None = None
    seconds: float = 0.0
    kind: str = "fix"
    # Rules that ran in the audited export and were dropped with this one because they require it.
    dependents: list[str] = field(default_factory=list)
    base_graph: GraphStats | None = None
    graph: GraphStats | None = None

    @property
    def nodes_saved(self) -> int | None:
        """Nodes the runtime's graph has fewer with the rule than without (None when not measured)."""
        if self.base_graph is None or self.graph is None:
            return None
        return self.graph.nodes - self.base_graph.nodes

    @property
    def op_changes(self) -> dict[str, int]:
        """Op type -> how many more the graph has without the rule (negative: fewer)."""
        if self.base_graph is None or self.graph is None:
            return {}
        ops = set(self.base_graph.ops) | set(self.graph.ops)
        changes = {op: self.graph.ops.get(op, 0) - self.base_graph.ops.get(op, 0) for op in sorted(ops)}
        return {op: delta for op, delta in changes.items() if delta}

    @property
    def needed(self) -> bool:
        if not self.exported or not self.matches:
            return True
        return self.kind == "optimization" and bool(self.nodes_saved and self.nodes_saved > 0)

    @property
    def verdict(self) -> str:
        text = self._verdict()
        if self.dependents:
            text += f"; disabling it also disabled {', '.join(self.dependents)} (they require it)"
        return text

    def _verdict(self) -> str:
        if not self.exported:
            return f"needed: without it the export fails ({self.error})"
        worst = max(self.max_abs_diff.values(), default=0.0)
        if not self.matches:
            return f"needed: without it the artifact differs from eager ({self.error or f'max abs diff {worst:.3g}'})"
        if self.kind != "optimization":
            return f"not needed here: exports and matches eager without it (max abs diff {worst:.3g})"
        saved, changes = self.nodes_saved, self.op_changes
        if saved is None or self.base_graph is None or self.graph is None:
            return f"numerics equal without it (max abs diff {worst:.3g}); its effect on the graph was not measured"
        sizes = f"{self.base_graph.nodes} vs {self.graph.nodes} nodes in {self.base_graph.where}"
        if changes:
            shown = sorted(changes.items(), key=lambda item: (-abs(item[1]), item[0]))[:6]
            sizes += "; without it " + ", ".join(f"{op} {delta:+d}" for op, delta in shown)
        if saved > 0:
            return f"needed for speed: {saved} node(s) fewer with it ({sizes}; max abs diff {worst:.3g})"
        if saved < 0:
            return f"not needed for speed here: {-saved} node(s) more with it ({sizes})"
        if changes:
            return f"changes the ops, not their number ({sizes})"
        return f"not needed here: the same graph without it ({sizes})"

    def to_dict(self) -> dict[str, Any]:
        return {
            **dataclasses.asdict(self),
            "nodes_saved": self.nodes_saved,
            "op_changes": self.op_changes,
            "needed": self.needed,
            "verdict": self.verdict,
        }


@dataclass
class RuleAudit:
    """One registered rule in one export."""

    id: str
    stage: str
    kind: str
    backends: list[str]
    hits: int
    status: str
    reason: str = ""
    expires: str | None = None
    expired: bool = False
    expiry: str = ""
    # Why the rule declined sites its pattern matched (reason -> count), from the engine.
    declined: dict[str, int] = field(default_factory=dict)
    explanation: str = ""
    ablation: Ablation | None = None

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["ablation"] = self.ablation.to_dict() if self.ablation else None
        return data


@dataclass
class Audit:
    """The audit of one model and format: rule rows, the export's own report, and the validation."""

    model: str
    model_class: str
    export_format: str
    exported: bool
    error: str = ""
    rules: list[RuleAudit] = field(default_factory=list)
    validation: dict[str, Any] | None = None
    report: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def hits(self) -> dict[str, int]:
        return {r.id: r.hits for r in self.rules if r.hits}

    @property
    def expired(self) -> list[str]:
        return [r.id for r in self.rules if r.expired]

    def rule(self, rule_id: str) -> RuleAudit:
        return next(r for r in self.rules if r.id == rule_id)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "model_class": self.model_class,
            "export_format": self.export_format,
            "exported": self.exported,
            "error": self.error,
            "hits": self.hits,
            "expired": self.expired,
            "rules": [r.to_dict() for r in self.rules],
            "validation": self.validation,
            "report": self.report,
            "seconds": round(self.seconds, 3),
        }

    def to_json(self, indent: int = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=str)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.to_json())
        return path

    def render(self, explain: bool = False, all_rules: bool = False, width: int = 120) -> str:
        """The table: one row per rule that ran in this export (fired or matched nothing; every registered rule
        with `all_rules`), then why each did or did not fire (`explain`) and the verdicts. Every line fits `width`
        columns: table rows are cut, explanations wrapped."""
        shown = [r for r in self.rules if all_rules or r.status in _RAN]
        head = f"audit: {self.model} ({self.model_class}) -> {self.export_format}: "
        head += "exported" if self.exported else f"export FAILED: {self.error}"
        if self.validation is not None:
            head += ", matches eager" if self.validation.get("ok") else ", DIFFERS from eager"
        rows = [("stage", "rule", "kind", "hits", "status", "expiry")]
        for r in shown:
            status = r.status if not r.reason or explain else f"{r.status}: {_shorten(r.reason, 60)}"
            rows.append((r.stage, r.id, r.kind, str(r.hits), status, "EXPIRED" if r.expired else (r.expires or "")))
        widths = [max(len(row[i]) for row in rows) for i in range(5)]
        lines = _wrapped(head, width)
        for row in rows:
            line = "  ".join(c.ljust(w) for c, w in zip(row[:5], widths, strict=True)) + "  " + row[5]
            lines.append(_shorten(line.rstrip(), width))
        hidden = Counter(r.status for r in self.rules if r not in shown)
        if hidden:
            counts = ", ".join(f"{n} {status}" for status, n in sorted(hidden.items()))
            lines += _wrapped(
                f"({sum(hidden.values())} more rule(s) did not run for this export: {counts}; --all lists them)", width
            )
        if explain:
            lines.append("")
            lines.append("why rules did or did not fire:")
            for r in shown:
                lines += _wrapped(f"  {r.id}: {r.explanation}", width, indent="      ")
        for r in self.rules:
            if r.expired:
                text = f"expired: {r.id} ({r.expiry}); re-run with it disabled and remove it if not needed"
                lines += _wrapped(text, width, indent="  ")
        ablated = [r for r in self.rules if r.ablation is not None]
        if ablated:
            lines.append("")
            lines.append("ablation (re-export with one rule disabled):")
            for r in ablated:
                assert r.ablation is not None
                lines += _wrapped(f"  {r.id}: {r.ablation.verdict} [{r.ablation.seconds:.1f}s]", width, indent="      ")
        lines.append(f"{len(self.hits)} rule(s) fired, {sum(self.hits.values())} hit(s), in {self.seconds:.1f}s")
        return "\n".join(lines)

    __str__ = render


def _shorten(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


def _wrapped(text: str, width: int, indent: str = "") -> list[str]:
    """`text` as lines of at most `width` columns, continuation lines indented by `indent`."""
    lead = text[: len(text) - len(text.lstrip())]
    return textwrap.wrap(
        text.lstrip(), width, initial_indent=lead, subsequent_indent=indent or lead, break_long_words=True
    ) or [text]


def _error_text(exc: BaseException) -> str:
    return _shorten(f"{type(exc).__name__}: {' '.join(str(exc).split())}", 300)


def with_rule_disabled(config: Any, rule_id: str) -> Any:
    """A copy of `config` whose rule selection also disables `rule_id`."""
    rules: RuleSelection = config.rules
    return dataclasses.replace(config, rules=RuleSelection(enable=rules.enable, disable=(*rules.disable, rule_id)))


def _save_config(config: Any) -> Any:
    # The audit compares against eager in f32: fp16 weight compression (OpenVINO's save default) is a storage
    # choice, not something a rule changes, and would blur the comparison.
    if hasattr(config, "compress_to_fp16"):
        return dataclasses.replace(config, compress_to_fp16=False)
    return config


@dataclass
class _Attempt:
    exported: bool
    error: str
    report: Any
    validation: Any
    graph: GraphStats | None = None


def graph_stats(artifact: str | Path, export_format: str) -> GraphStats | None:
    """Node count and op histogram of what the runtime executes for a saved artifact (every component).

    ONNX: the graph ONNX Runtime runs after its own optimizations (function bodies inlined, contrib fusions),
    which is what an ONNX-level fusion changes; OpenVINO: the compiled CPU runtime model; Dynamo: the
    program's ATen graph. None for ExecuTorch (no optimization rules there yet) or an unreadable artifact.
    """
    artifact = Path(artifact)
    ops: Counter[str] = Counter()
    try:
        if export_format == "onnx":
            import onnx
            import onnxruntime as ort

            where = "ONNX Runtime's optimized CPU graph"
            for index, path in enumerate(sorted(artifact.rglob("*.onnx"))):
                options = ort.SessionOptions()
                optimized = artifact / f".hfexport-audit-optimized-{index}.onnx"
                options.optimized_model_filepath = str(optimized)
                ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
                graph = onnx.load(str(optimized), load_external_data=False).graph
                ops.update(f"{n.domain}.{n.op_type}" if n.domain else n.op_type for n in graph.node)
        elif export_format == "openvino":
            import openvino as ov

            where = "OpenVINO's compiled CPU model"
            core = ov.Core()
            for path in sorted(artifact.rglob("*.xml")):
                runtime = core.compile_model(str(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"}).get_runtime_model()
                ops.update(op.get_rt_info()["layerType"].astype(str) for op in runtime.get_ordered_ops())
        elif export_format == "dynamo":
            import torch

            where = "the exported ATen graph"
            for path in sorted(artifact.rglob("*.pt2")):
                graph = torch.export.load(str(path)).graph  # the artifact this audit saved itself
                ops.update(str(n.target) for n in graph.nodes if n.op == "call_function")
        else:
            return None
    except Exception:
        return None  # measuring is best effort: the verdict then says the graph was not measured
    return GraphStats(where, sum(ops.values()), dict(sorted(ops.items())))


def _export_and_validate(model: Any, inputs: Mapping[str, Any], config: Any, atol: float, rtol: float) -> _Attempt:
    from hfexport.artifacts import save, validate
    from hfexport.auto import AutoHfExporter

    exporter = AutoHfExporter.from_config(config)
    try:
        program = exporter.export(model, inputs, config=config)
    except Exception as exc:
        return _Attempt(False, _error_text(exc), exporter.report, None)
    with tempfile.TemporaryDirectory(prefix="hfexport-audit-") as tmp:
        try:
            artifact = Path(tmp) / "artifact"
            save(program, artifact, config=_save_config(config), report=exporter.report)
            # trust: the .pt2 is the one saved a line above.
            validation = validate(artifact, model, inputs, atol=atol, rtol=rtol, trust=True)
        except Exception as exc:
            # Exported, but the artifact does not save or run in its runtime: as good as a failed export.
            return _Attempt(False, f"the artifact does not run: {_error_text(exc)}", exporter.report, None)
        graph = graph_stats(artifact, config.export_format)
    return _Attempt(True, "", exporter.report, validation, graph)


def run_audit(
    model: Any,
    inputs: Mapping[str, Any],
    config: Any,
    *,
    model_name: str = "",
    ablate: bool | Sequence[str] = False,
    atol: float = 1e-4,
    rtol: float = 1e-3,
    progress: Progress | None = None,
) -> Audit:
    """Export `model` with `config`, validate the artifact, list every rule; ablate fired rules when asked.

    `ablate`: True ablates every rule that fired; a sequence ablates exactly those rule ids.
    """
    from hfexport.rewrites.declines import explaining_declines
    from hfexport.rewrites.engine import default_registry

    with explaining_declines():
        return _run_audit(model, inputs, config, model_name, ablate, atol, rtol, progress, default_registry())


def _run_audit(
    model: Any,
    inputs: Mapping[str, Any],
    config: Any,
    model_name: str,
    ablate: bool | Sequence[str],
    atol: float,
    rtol: float,
    progress: Progress | None,
    registry: Any,
) -> Audit:
    say = progress or (lambda _message: None)
    registry.validate_selection(config.rules)
    start = time.perf_counter()
    say(f"exporting {type(model).__name__} to {config.export_format}")
    base = _export_and_validate(model, inputs, config, atol, rtol)
    report = base.report
    outcomes = {o.id: o for o in (report.rules if report is not None else [])}
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    rows = [
        _rule_row(rule, outcomes.get(rule.id), config.export_format, model_type, base.exported)
        for rule in registry.rules()
    ]

    if ablate:
        targets = [r.id for r in rows if r.hits] if ablate is True else list(ablate)
        for rule_id in targets:
            registry.get(rule_id)  # an unknown id fails here, not after minutes of exports
        running = registry.plan(config.rules, config.export_format)
        ablating = time.perf_counter()
        for i, rule_id in enumerate(targets, 1):
            ablated = with_rule_disabled(config, rule_id)
            # The engine drops the rules that require this one (RuleRegistry.plan); say which went with it.
            without = registry.plan(ablated.rules, config.export_format)
            dependents = [
                other.id
                for other in registry.rules()
                if other.id != rule_id
                and running[other.id] is None
                and without[other.id] is not None
                and other.applies_to(config.export_format)
            ]
            left = eta(i - 1, len(targets), time.perf_counter() - ablating)
            say(f"ablation {i}/{len(targets)}: exporting without {rule_id}; {left}")
            t0 = time.perf_counter()
            attempt = _export_and_validate(model, inputs, ablated, atol, rtol)
            ablation = Ablation(
                rule_id,
                attempt.exported,
                attempt.error,
                seconds=time.perf_counter() - t0,
                kind=registry.get(rule_id).meta.kind,
                dependents=dependents,
                base_graph=base.graph,
                graph=attempt.graph,
            )
            if attempt.validation is not None:
                ablation.max_abs_diff = attempt.validation.max_abs_diff
                ablation.matches = attempt.validation.ok
                if not attempt.validation.ok:
                    ablation.error = "; ".join(
                        o.problem or f"{o.name} max abs diff {o.max_abs_diff:.3g} > {o.tolerance:.3g}"
                        for o in attempt.validation.outputs
                        if not o.ok
                    )
            next(r for r in rows if r.id == rule_id).ablation = ablation

    return Audit(
        model=model_name or type(model).__name__,
        model_class=type(model).__name__,
        export_format=config.export_format,
        exported=base.exported,
        error=base.error,
        rules=rows,
        validation=base.validation.to_dict() if base.validation is not None else None,
        report=report.to_dict() if report is not None else {},
        seconds=time.perf_counter() - start,
    )


def _rule_row(rule: Rule, outcome: Any, export_format: str, model_type: str | None, exported: bool) -> RuleAudit:
    meta = rule.meta
    expired, expiry = expiry_status(meta)
    declined: dict[str, int] = {}
    if outcome is not None:
        status, reason, hits = outcome.status, outcome.reason, outcome.hits
        declined = dict(getattr(outcome, "declined", {}) or {})
    elif not rule.applies_to(export_format):
        status, reason, hits = "other-backend", f"only for {', '.join(meta.backends)}", 0
    elif rule.stage not in FORMAT_STAGES.get(export_format, STAGES):
        status, reason, hits = "not-run", f"stage {rule.stage!r} does not run for {export_format}", 0
    else:
        why = "the export failed before it" if not exported else "this configuration does not run it"
        status, reason, hits = "not-run", f"stage {rule.stage!r} did not run: {why}", 0
    row = RuleAudit(
        id=meta.id,
        stage=rule.stage,
        kind=meta.kind,
        backends=list(meta.backends),
        hits=hits,
        status=status,
        reason=reason,
        expires=meta.expires,
        expired=expired,
        expiry=expiry,
        declined=declined,
    )
    row.explanation = _explain(row, meta, model_type)
    return row


def _declined_text(declined: dict[str, int]) -> str:
    total = sum(declined.values())
    reasons = sorted(declined.items(), key=lambda item: (-item[1], item[0]))
    listed = "; ".join(f"{reason} (x{count})" if count > 1 else reason for reason, count in reasons[:5])
    more = f"; and {len(reasons) - 5} more reason(s)" if len(reasons) > 5 else ""
    return f"declined {total} matched site(s): {listed}{more}"


def _explain(row: RuleAudit, meta: RuleMeta, model_type: str | None) -> str:
    if row.status == "fired":
        text = f"fired {row.hits} time(s) in stage {row.stage!r}"
        return text + (f"; {_declined_text(row.declined)}" if row.declined else "")
    if row.status != "no-match":
        return f"{row.status}: {row.reason}"
    if row.declined:
        # Its pattern matched, and its check said why each match was left alone.
        return f"ran in stage {row.stage!r} and fired nowhere: {_declined_text(row.declined)}"
    # No site matched the pattern at all: say what the rule looks for instead.
    matches = [e.description for e in meta.examples if type(e).__name__ == "Match" and e.description]
    text = f"ran in stage {row.stage!r} and matched nothing"
    if matches:
        text += "; it fires on e.g. " + "; ".join(matches)
    if meta.models:
        inside = model_type in meta.models
        text += f"; written for {', '.join(meta.models)}" + (f" (including {model_type})" if inside else "")
    return text


# -- inspecting one rule -----------------------------------------------------------------------------------


def expiry_status(meta: RuleMeta) -> tuple[bool, str]:
    """(expired, detail): whether the installed package satisfies the rule's `expires` requirement."""
    if not meta.expires:
        return False, ""
    from packaging.requirements import Requirement
    from packaging.version import Version

    from hfexport.versions import installed_version

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
    root = Path(__file__).resolve().parent.parent  # the folder that holds the hfexport package
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
