"""ExportReport: what one export did — rules fired per stage, rules skipped and why, timings, warnings."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hfexport.rewrites.engine import RewriteContext, RuleOutcome
from hfexport.rewrites.rule import STAGES


@dataclass
class QuantizationRecord:
    """Which quantizer ran during an export, where, on how many ops, and how long it took.

    stage: "eager" (a copy of the model, before capture), "fx" (the captured graph, before lowering) or the
        backend (`onnx`, `openvino`) it ran after.
    op_counts: quantization ops in the result by kind (Q/DQ pairs, MatMulInteger, MatMulNBits, FakeQuantize,
        compressed int8/int4 constants; at "eager", the quantized weights by tensor class); `quantized_ops` is
        their sum.
    """

    quantizer: str
    stage: str
    settings: dict[str, Any] = field(default_factory=dict)
    op_counts: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    calibration_samples: int | None = None

    @property
    def quantized_ops(self) -> int:
        return sum(self.op_counts.values())

    def to_dict(self) -> dict[str, Any]:
        return {
            "quantizer": self.quantizer,
            "stage": self.stage,
            "settings": self.settings,
            "op_counts": dict(self.op_counts),
            "quantized_ops": self.quantized_ops,
            "seconds": round(self.seconds, 4),
            "calibration_samples": self.calibration_samples,
        }


@dataclass
class AccuracyRecord:
    """A quantized export against its float model on held-out text (`hfexport.quantization_accuracy`).

    Next-token figures over `tokens` predictions: the float model's and the export's perplexity, the mean KL
    divergence KL(float || export) of the next-token distributions (nats), and the share of positions where both
    pick the same top-1 token. `first_divergence`: the first generated token (0-based) where greedy generation of
    the export leaves the float model's, over `greedy_tokens` new tokens per prompt; None: none did.
    `meaningful` is False where the float model's perplexity is near uniform over its vocabulary (random or
    untrained weights): then the figures say nothing about the recipe, and no budget applies. `budget` holds the
    limits the record was held to (`perplexity_change`: the largest relative increase; `top1_agreement`: the
    smallest agreement), named after the recipe's `precision` ("int8", "int8-weights", "int4").
    """

    precision: str
    text: str
    tokens: int
    vocab_size: int
    float_perplexity: float
    perplexity: float
    kl_divergence: float
    top1_agreement: float
    greedy_tokens: int = 0
    first_divergence: int | None = None
    meaningful: bool = True
    budget: dict[str, float] | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def perplexity_change(self) -> float:
        """The export's perplexity relative to the float model's, minus 1 (0.01: 1 % higher)."""
        return self.perplexity / self.float_perplexity - 1.0

    @property
    def exceeded(self) -> list[str]:
        """The budget's limits this record exceeds (empty when it has no budget or is not meaningful)."""
        if not self.meaningful or not self.budget:
            return []
        over = []
        limit = self.budget.get("perplexity_change")
        if limit is not None and not self.perplexity_change <= limit:  # NaN exceeds too
            over.append(f"perplexity {self.perplexity_change:+.2%} > +{limit:.2%}")
        least = self.budget.get("top1_agreement")
        if least is not None and not self.top1_agreement >= least:
            over.append(f"top-1 agreement {self.top1_agreement:.2%} < {least:.2%}")
        return over

    @property
    def ok(self) -> bool:
        return not self.exceeded

    def to_dict(self) -> dict[str, Any]:
        def number(value: float) -> float | str:
            return round(value, 6) if value == value and abs(value) != float("inf") else str(value)

        return {
            "ok": self.ok,
            "meaningful": self.meaningful,
            "precision": self.precision,
            "text": self.text,
            "tokens": self.tokens,
            "vocab_size": self.vocab_size,
            "float_perplexity": number(self.float_perplexity),
            "perplexity": number(self.perplexity),
            "perplexity_change": number(self.perplexity_change),
            "kl_divergence": number(self.kl_divergence),
            "top1_agreement": number(self.top1_agreement),
            "greedy_tokens": self.greedy_tokens,
            "first_divergence": self.first_divergence,
            "budget": dict(self.budget) if self.budget else None,
            "exceeded": self.exceeded,
            "notes": list(self.notes),
        }

    def summary(self) -> str:
        """One line: the figures, and the verdict against the budget."""
        diverged = "never" if self.first_divergence is None else f"at token {self.first_divergence}"
        line = (
            f"perplexity {self.float_perplexity:.3f} -> {self.perplexity:.3f} ({self.perplexity_change:+.2%}), "
            f"KL {self.kl_divergence:.4f}, top-1 {self.top1_agreement:.2%}, greedy diverges {diverged}"
            f" of {self.greedy_tokens}"
        )
        if not self.meaningful:
            return line + " [not meaningful: the float model is near uniform on this text]"
        if self.budget:
            return line + (f" [{self.precision} budget: " + ("ok" if self.ok else "; ".join(self.exceeded)) + "]")
        return line


# Statuses of a rule that ran in the export: the default table shows these.
_RAN = ("fired", "no-match")


@dataclass
class ExportReport:
    export_format: str
    model_class: str
    model_type: str | None = None
    component: str | None = None
    rules: list[RuleOutcome] = field(default_factory=list)
    stage_seconds: dict[str, float] = field(default_factory=dict)
    total_seconds: float = 0.0
    warnings: list[str] = field(default_factory=list)
    # Defaults the export chose for the caller, and why (e.g. the opset a quantizer needs).
    notes: list[str] = field(default_factory=list)
    parity: dict[str, float] | None = None
    versions: dict[str, str] = field(default_factory=dict)
    quantization: QuantizationRecord | None = None
    # What the export actually used where the config left a choice open (the opset written, the fusions that
    # fired, the dtype the weights were traced in), so the report and manifest never say only `null`.
    used: dict[str, Any] = field(default_factory=dict)
    # A quantized export measured against its float model (`export --validate`, `quantization_accuracy`).
    accuracy: AccuracyRecord | None = None

    @classmethod
    def from_context(cls, context: RewriteContext, **kwargs: Any) -> ExportReport:
        order = {s: i for i, s in enumerate(STAGES)}
        outcomes = sorted(context.outcomes.values(), key=lambda o: order.get(o.stage, len(order)))
        return cls(rules=outcomes, stage_seconds=dict(context.stage_seconds), **kwargs)

    @property
    def hits(self) -> dict[str, dict[str, int]]:
        """Rules that fired, by stage: {stage: {rule id: hits}}."""
        by_stage: dict[str, dict[str, int]] = {}
        for outcome in self.rules:
            if outcome.hits:
                by_stage.setdefault(outcome.stage, {})[outcome.id] = outcome.hits
        return by_stage

    @property
    def fired(self) -> list[str]:
        return [o.id for o in self.rules if o.hits]

    @property
    def not_applicable(self) -> dict[str, str]:
        return {o.id: o.reason for o in self.rules if o.status == "not-applicable"}

    def to_dict(self) -> dict[str, Any]:
        return {
            "export_format": self.export_format,
            "model_class": self.model_class,
            "model_type": self.model_type,
            "component": self.component,
            "hits": self.hits,
            "rules": [o.to_dict() for o in self.rules],
            "stage_seconds": {k: round(v, 4) for k, v in self.stage_seconds.items()},
            "total_seconds": round(self.total_seconds, 4),
            "warnings": list(self.warnings),
            "notes": list(self.notes),
            "parity": self.parity,
            "versions": dict(self.versions),
            "quantization": self.quantization.to_dict() if self.quantization else None,
            "used": dict(self.used),
            "accuracy": self.accuracy.to_dict() if self.accuracy else None,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ExportReport:
        """The report `to_dict()` wrote (a saved artifact's `report.json` or manifest entry), rebuilt for
        rendering. Plain data from a file: a field of the wrong type is left at its default, never trusted."""

        def field_of(key: str, kind: type | tuple[type, ...], default: Any) -> Any:
            value = data.get(key, default)
            return value if isinstance(value, kind) else default

        rules = []
        for row in field_of("rules", list, []):
            if isinstance(row, Mapping) and all(isinstance(row.get(k), str) for k in ("id", "stage", "kind")):
                hits = row.get("hits")
                declined = row.get("declined")
                rules.append(
                    RuleOutcome(
                        row["id"],
                        row["stage"],
                        row["kind"],
                        hits if type(hits) is int else 0,
                        str(row.get("status", "no-match")),
                        str(row.get("reason") or ""),
                        {str(k): v for k, v in declined.items() if type(v) is int}
                        if isinstance(declined, Mapping)
                        else {},
                        origin=str(row.get("origin") or ""),
                    )
                )
        quantization = data.get("quantization")
        record = None
        if isinstance(quantization, Mapping) and isinstance(quantization.get("quantizer"), str):
            counts = quantization.get("op_counts")
            record = QuantizationRecord(
                quantization["quantizer"],
                str(quantization.get("stage", "")),
                op_counts={str(k): v for k, v in counts.items() if type(v) is int}
                if isinstance(counts, Mapping)
                else {},
                seconds=float(quantization.get("seconds") or 0.0),
            )
        parity = field_of("parity", dict, None)
        return cls(
            export_format=str(data.get("export_format", "")),
            model_class=str(data.get("model_class", "")),
            model_type=field_of("model_type", str, None),
            component=field_of("component", str, None),
            rules=rules,
            stage_seconds={
                str(k): float(v) for k, v in field_of("stage_seconds", dict, {}).items() if isinstance(v, int | float)
            },
            total_seconds=float(field_of("total_seconds", int | float, 0.0)),
            warnings=[str(w) for w in field_of("warnings", list, [])],
            notes=[str(n) for n in field_of("notes", list, [])],
            parity={str(k): v for k, v in parity.items() if isinstance(v, int | float)} if parity else None,
            versions={str(k): str(v) for k, v in field_of("versions", dict, {}).items()},
            quantization=record,
            used=dict(field_of("used", dict, {})),
        )

    def to_json(self, indent: int = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.to_json())
        return path

    def __str__(self) -> str:
        return self.table()

    def table(self, all_rules: bool = False, width: int | None = None) -> str:
        """The report as text: the rules that ran for this format (fired or matched nothing), then timings,
        quantization, notes, warnings and parity. `all_rules` also lists the rules of other backends, the
        not-applicable and the disabled ones (`to_dict()` always has every rule). Lines are cut to `width`
        (default: the terminal's)."""
        width = width or shutil.get_terminal_size((120, 24)).columns
        title = f"{self.model_class} -> {self.export_format}"
        if self.component:
            title += f" [{self.component}]"
        lines = [f"{title} in {self.total_seconds:.2f}s"]
        shown = [o for o in self.rules if all_rules or o.status in _RAN]
        rows = [("stage", "rule", "kind", "hits", "status")]
        rows += [(o.stage, o.id, o.kind, str(o.hits), o.status + (f": {o.reason}" if o.reason else "")) for o in shown]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        for row in rows:
            line = "  ".join(c.ljust(w) for c, w in zip(row[:4], widths, strict=True)) + "  " + row[4]
            lines.append(line if len(line) <= width else line[: max(width - 1, 20)] + "…")
        hidden = Counter(o.status for o in self.rules if o not in shown)
        if hidden:
            counts = ", ".join(f"{n} {status}" for status, n in sorted(hidden.items()))
            lines.append(
                f"({sum(hidden.values())} more rule(s) did not run for this export: {counts}; "
                "`--all` or report.table(all_rules=True) lists them)"
            )
        if self.stage_seconds:
            lines.append("time: " + ", ".join(f"{k} {v:.2f}s" for k, v in self.stage_seconds.items()))
        if self.quantization:
            q = self.quantization
            counts = ", ".join(f"{k} {v}" for k, v in q.op_counts.items()) or "none"
            lines.append(f"quantization: {q.quantizer} at stage {q.stage!r} in {q.seconds:.2f}s, ops: {counts}")
        if self.accuracy:
            lines.append(f"accuracy against the float model ({self.accuracy.text}): {self.accuracy.summary()}")
        if self.used:
            lines.append("used: " + ", ".join(f"{k} {v}" for k, v in self.used.items()))
        lines += [f"note: {n}" for n in self.notes]
        lines += [f"warning: {w}" for w in self.warnings]
        if self.parity:
            lines.append("parity (max abs diff): " + ", ".join(f"{k} {v:.3g}" for k, v in self.parity.items()))
        return "\n".join(lines)
