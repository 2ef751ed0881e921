"""What an audit found (`Audit`: a `RuleAudit` per rule, with its `Ablation` and `GraphStats` when ablated) and its
terminal table; `hfexport.apps.audit.run_audit` makes one, `hfexport.apps.render` writes it as Markdown or HTML."""

from __future__ import annotations

import dataclasses
import json
import textwrap
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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
            status = r.status if not r.reason or explain else f"{r.status}: {shorten(r.reason, 60)}"
            rows.append((r.stage, r.id, r.kind, str(r.hits), status, "EXPIRED" if r.expired else (r.expires or "")))
        widths = [max(len(row[i]) for row in rows) for i in range(5)]
        lines = _wrapped(head, width)
        for row in rows:
            line = "  ".join(c.ljust(w) for c, w in zip(row[:5], widths, strict=True)) + "  " + row[5]
            lines.append(shorten(line.rstrip(), width))
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


def shorten(text: str, width: int) -> str:
    """`text` cut to `width` characters, "..." saying so."""
    return text if len(text) <= width else text[: width - 3] + "..."


def _wrapped(text: str, width: int, indent: str = "") -> list[str]:
    """`text` as lines of at most `width` columns, continuation lines indented by `indent`."""
    lead = text[: len(text) - len(text.lstrip())]
    return textwrap.wrap(
        text.lstrip(), width, initial_indent=lead, subsequent_indent=indent or lead, break_long_words=True
    ) or [text]
