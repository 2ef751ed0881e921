"""Audit rewrite rules: what each did in one export, whether it has expired, and whether it is still needed.

`run_audit` exports a model once and lists every registered rule with its stage, kind, hits and status
(fired, no match, not applicable and why, disabled, other backend), plus whether its `expires`
requirement is met by the installed packages. With `ablate`, it re-exports once per fired rule with only
that rule disabled (`RuleSelection(disable=(id,))` added to the config's selection; the rules that require
it go with it, as the engine plans, and are named), runs the saved artifact in its own runtime against
eager, and calls a fix *needed* when the export then fails or no longer matches eager. An optimization
keeps numerics by design, so it is judged by the graph its runtime executes: node count and op histogram
with and without it ("needed for speed: N nodes fewer").
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfexport.apps.audit_records import Ablation, Audit, GraphStats, RuleAudit, shorten
from hfexport.backends.registry import backend, find
from hfexport.core.timing import eta
from hfexport.rewrites.catalogue import expiry_status
from hfexport.rewrites.rule import STAGES, Rule, RuleMeta, RuleSelection

Progress = Callable[[str], None]


def _error_text(exc: BaseException) -> str:
    return shorten(f"{type(exc).__name__}: {' '.join(str(exc).split())}", 300)


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
    """Node count and op histogram of what the runtime executes for a saved artifact (every component): the
    backend's `Ops.runtime_op_counts` (ONNX: the graph ONNX Runtime runs after its own optimizations, which is what
    an ONNX-level fusion changes; OpenVINO: the compiled CPU runtime model; Dynamo: the program's ATen graph). None
    where a backend has no such count (ExecuTorch: no optimization rules there yet) or the artifact is unreadable.
    """
    try:
        counted = backend(export_format).ops.load().runtime_op_counts(Path(artifact))
    except Exception:
        return None  # measuring is best effort: the verdict then says the graph was not measured
    if counted is None:
        return None
    where, ops = counted
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
        # The rules this format runs (its own and those of the backend whose rules it runs: aoti runs Dynamo's).
        rules_of = str(config.export_format)
        running = registry.plan(config.rules, rules_of)
        ablating = time.perf_counter()
        for i, rule_id in enumerate(targets, 1):
            ablated = with_rule_disabled(config, rule_id)
            # The engine drops the rules that require this one (RuleRegistry.plan); say which went with it.
            without = registry.plan(ablated.rules, rules_of)
            dependents = [
                other.id
                for other in registry.rules()
                if other.id != rule_id
                and running[other.id] is None
                and without[other.id] is not None
                and other.applies_to(rules_of)
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
    known = find(export_format)
    expired, expiry = expiry_status(meta)
    declined: dict[str, int] = {}
    if outcome is not None:
        status, reason, hits = outcome.status, outcome.reason, outcome.hits
        declined = dict(getattr(outcome, "declined", {}) or {})
    elif not rule.applies_to(str(export_format)):
        status, reason, hits = "other-backend", f"only for {', '.join(meta.backends)}", 0
    elif rule.stage not in (known.stages if known is not None else STAGES):
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
