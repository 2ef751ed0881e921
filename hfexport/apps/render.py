"""Markdown and self-contained static HTML renderings of an export's report and of an audit.

One document model (`Document`: a title, summary lines and sections of paragraphs, lists and tables) is built
from an `ExportReport` (plus the `--validate` record) or an `Audit`, then written out by one of two writers,
so the Markdown (for a PR comment or a wiki) and the HTML (for a browser) always say the same thing. The HTML
has inline CSS and no script, link or image: it opens offline, and every text from a model, a rule or an
error is escaped. In the Markdown every text is escaped too (`_md_text`): a value renders as itself, on its
own line, so a newline or a `#` in a model path or class name cannot forge a heading or a list item. In both,
control characters and the lone surrogates of an undecodable file name are shown as backslash escapes.
"""

from __future__ import annotations

import html
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from hfexport.apps.audit_records import Audit
from hfexport.report import ExportReport

# Statuses of a rule that ran in the export: the report lists these (as the printed table does).
_RAN = ("fired", "no-match")
RENDER_FORMATS = ("markdown", "html")


@dataclass
class Table:
    headers: list[str]
    rows: list[list[str]]
    # One CSS class per row ("" for none): `fired`, `ok`, `fail`; the Markdown writer ignores them.
    row_classes: list[str] = field(default_factory=list)


@dataclass
class Section:
    title: str
    paragraphs: list[str] = field(default_factory=list)
    items: list[str] = field(default_factory=list)
    table: Table | None = None
    # Closed until opened (HTML `<details>`): what a reader rarely needs, e.g. the rules that did not run.
    folded: bool = False


@dataclass
class Document:
    title: str
    summary: list[str] = field(default_factory=list)
    sections: list[Section] = field(default_factory=list)


# -- building documents -----------------------------------------------------------------------------------


def _rule_meta(rule_id: str) -> tuple[str, str]:
    """(why, upstream) of a registered rule; blanks for an id this process does not know (an old report)."""
    from hfexport.rewrites.engine import default_registry

    try:
        meta = default_registry().get(rule_id).meta
    except KeyError:
        return "", ""
    return meta.why, meta.upstream


def _rules_sections(report: ExportReport, prefix: str) -> tuple[list[Section], list[Section]]:
    """One section per stage with the rules that ran in it (those that fired first, then those that matched
    nothing), why and upstream; and, apart, the folded section of the rules that did not run and why."""
    sections: list[Section] = []
    by_stage: dict[str, list[Any]] = {}
    for outcome in report.rules:
        if outcome.status in _RAN:
            by_stage.setdefault(outcome.stage, []).append(outcome)
    for stage, outcomes in by_stage.items():
        outcomes = sorted(outcomes, key=lambda o: not o.hits)  # stable: fired first, stage order kept
        rows, classes = [], []
        # Sites a rule's pattern matched and it left alone, with the reason: a column only where there are some.
        declined = any(o.declined for o in outcomes)
        for o in outcomes:
            why, upstream = _rule_meta(o.id)
            row = [o.id, o.kind, str(o.hits), "fired" if o.hits else "matched nothing", why, upstream]
            if declined:
                row.append(", ".join(f"{reason} x{n}" for reason, n in o.declined.items()))
            rows.append(row)
            classes.append("fired" if o.hits else "")
        fired = sum(1 for o in outcomes if o.hits)
        headers = ["rule", "kind", "hits", "status", "why", "upstream"] + (["declined"] if declined else [])
        sections.append(
            Section(
                f"{prefix}Rules at stage {stage}",
                paragraphs=[f"{fired} of {len(outcomes)} rule(s) that ran at this stage fired."],
                table=Table(headers, rows, classes),
            )
        )
    others = [o for o in report.rules if o.status not in _RAN]
    folded = []
    if others:
        counts: dict[str, int] = {}
        for o in others:
            counts[o.status] = counts.get(o.status, 0) + 1
        folded.append(
            Section(
                f"{prefix}Rules that did not run",
                paragraphs=[", ".join(f"{n} {status}" for status, n in sorted(counts.items())) + "."],
                table=Table(
                    ["rule", "stage", "status", "reason"], [[o.id, o.stage, o.status, o.reason] for o in others]
                ),
                folded=True,
            )
        )
    return sections, folded


def _report_sections(report: ExportReport, prefix: str = "") -> tuple[list[Section], list[Section]]:
    """The sections of one report: the rules that ran, timings, what the export used, warnings; and apart, the
    folded ones that go at the end of the document (the rules that did not run)."""
    sections, folded = _rules_sections(report, prefix)
    if report.stage_seconds:
        rows = [[stage, f"{seconds:.2f}"] for stage, seconds in report.stage_seconds.items()]
        rows.append(["total", f"{report.total_seconds:.2f}"])
        sections.append(Section(f"{prefix}Stage timings", table=Table(["stage", "seconds"], rows)))
    used = [[key, _text(value)] for key, value in report.used.items()]
    if report.quantization:
        q = report.quantization
        counts = ", ".join(f"{k} {v}" for k, v in q.op_counts.items()) or "none"
        used.append(["quantization", f"{q.quantizer} at stage {q.stage} in {q.seconds:.2f}s, ops: {counts}"])
    if used:
        sections.append(Section(f"{prefix}What the export used", table=Table(["setting", "value"], used)))
    if report.warnings or report.notes:
        sections.append(
            Section(
                f"{prefix}Warnings and notes",
                items=[f"warning: {w}" for w in report.warnings] + [f"note: {n}" for n in report.notes],
            )
        )
    return sections, folded


def _text(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, Mapping):
        return ", ".join(f"{k}: {_text(v)}" for k, v in value.items()) or "none"
    if isinstance(value, list | tuple):
        return ", ".join(_text(v) for v in value) or "none"
    return "none" if value is None else str(value)


def _shape_text(shapes: Mapping[str, Any]) -> str:
    return ", ".join(f"{name} {list(shape)}" for name, shape in shapes.items())


def _validation_section(validation: Mapping[str, Any]) -> Section:
    """The `--validate` record (`Validation.to_dict()`, or a generation export's token comparison)."""
    verdict = _verdict(validation)
    if "outputs" not in validation:  # a generation export: components run and greedy tokens compared
        rows = [[key, _text(value)] for key, value in validation.items()]
        return Section(f"Validation: {verdict}", table=Table(["check", "result"], rows))
    rows, classes = [], []
    tolerance = f"|diff| <= atol {validation.get('atol')} + rtol {validation.get('rtol')} * max|eager|"
    if validation.get("tolerance_source"):
        tolerance += f": {validation['tolerance_source']}"
    for o in validation.get("outputs", []):
        detail = o.get("problem") or f"{o['max_abs_diff']:.3g} (tolerance {o['tolerance']:.3g})"
        rows.append(["sample", o["name"], str(list(o.get("shape", []))), detail, "ok" if o.get("ok") else "FAIL"])
        classes.append("ok" if o.get("ok") else "fail")
    for check in validation.get("shapes", []):
        label = f"{check['name']} ({_shape_text(check.get('shapes', {}))})"
        if check.get("skipped"):
            rows.append([label, "", "", check["skipped"], "skipped"])
            classes.append("skip")
            continue
        if check.get("problem"):
            rows.append([label, "", "", check["problem"], "FAIL"])
            classes.append("fail")
            continue
        for o in check.get("outputs", []):
            detail = o.get("problem") or f"{o['max_abs_diff']:.3g} (tolerance {o['tolerance']:.3g})"
            rows.append([label, o["name"], str(list(o.get("shape", []))), detail, "ok" if o.get("ok") else "FAIL"])
            classes.append("ok" if o.get("ok") else "fail")
    return Section(
        f"Validation: {verdict}",
        paragraphs=[f"The saved artifact run in its runtime against eager, per input shape ({tolerance})."],
        table=Table(["inputs", "output", "shape", "max abs diff", "verdict"], rows, classes),
    )


def export_document(
    reports: ExportReport | Mapping[str, ExportReport],
    validation: Mapping[str, Any] | None = None,
    model: str | None = None,
) -> Document:
    """The document of one export (or of a generation export: `{component: report}`) and its validation.

    The verdict first (the validation per input shape, or that none ran), then the rules that fired (per
    stage, beside those that ran and matched nothing), timings, what the export used, warnings and versions;
    the rules that did not run come last, folded.
    """
    named = {"": reports} if isinstance(reports, ExportReport) else dict(reports)
    first = next(iter(named.values()))
    title = f"hfexport: {model or first.model_class} -> {first.export_format}"
    doc = Document(title)
    if validation is not None:
        doc.summary.append("Validation: " + _verdict(validation) + ".")
        doc.sections.append(_validation_section(validation))
    else:
        doc.summary.append("Validation: not run (export with --validate to compare the artifact with eager).")
    folded: list[Section] = []
    for name, report in named.items():
        label = f"{report.model_class} -> {report.export_format}" + (f" [{name}]" if name else "")
        doc.summary.append(
            f"{label}: {len(report.fired)} rule(s) fired, {sum(o.hits for o in report.rules)} hit(s), "
            f"exported in {report.total_seconds:.2f}s."
        )
        sections, later = _report_sections(report, prefix=f"{name}: " if name else "")
        doc.sections += sections
        folded += later
    versions = first.versions
    if versions:
        doc.sections.append(
            Section("Versions", table=Table(["package", "version"], [[k, v] for k, v in versions.items()]))
        )
    doc.sections += folded
    return doc


def _verdict(validation: Mapping[str, Any]) -> str:
    if validation.get("error"):
        return f"FAILED: it could not run ({validation['error']})"
    return "matches eager" if validation.get("ok") else "DIFFERS from eager"


def audit_document(audit: Audit) -> Document:
    """The document of an audit: every rule of the format with its explanation, ablation verdicts, validation."""
    doc = Document(f"hfexport audit: {audit.model} ({audit.model_class}) -> {audit.export_format}")
    doc.summary.append("exported" if audit.exported else f"export FAILED: {audit.error}")
    doc.summary.append(
        f"{len(audit.hits)} rule(s) fired, {sum(audit.hits.values())} hit(s), audit took {audit.seconds:.1f}s."
    )
    shown = [r for r in audit.rules if r.status != "other-backend"]
    rows, classes = [], []
    for r in shown:
        why, upstream = _rule_meta(r.id)
        expiry = "EXPIRED" if r.expired else (r.expires or "")
        rows.append([r.stage, r.id, r.kind, str(r.hits), r.status, r.explanation or r.reason, why, upstream, expiry])
        classes.append("fired" if r.hits else "")
    doc.sections.append(
        Section(
            "Rules",
            paragraphs=[f"{len(audit.rules) - len(shown)} rule(s) of other backends are not listed."],
            table=Table(
                ["stage", "rule", "kind", "hits", "status", "explanation", "why", "upstream", "expiry"], rows, classes
            ),
        )
    )
    ablated = [r for r in audit.rules if r.ablation is not None]
    if ablated:
        rows = [[r.id, r.ablation.verdict, f"{r.ablation.seconds:.1f}"] for r in ablated if r.ablation]
        classes = ["fail" if r.ablation and r.ablation.needed else "ok" for r in ablated]
        doc.sections.append(
            Section(
                "Ablation (re-export with one rule disabled)",
                table=Table(["rule", "verdict", "seconds"], rows, classes),
            )
        )
    if audit.report:
        report = audit.report
        stage_rows = [[k, f"{v:.2f}"] for k, v in report.get("stage_seconds", {}).items()]
        if stage_rows:
            doc.sections.append(Section("Stage timings (base export)", table=Table(["stage", "seconds"], stage_rows)))
        used = [[k, _text(v)] for k, v in (report.get("used") or {}).items()]
        if used:
            doc.sections.append(Section("What the export used", table=Table(["setting", "value"], used)))
        notes = [f"warning: {w}" for w in report.get("warnings", [])] + [f"note: {n}" for n in report.get("notes", [])]
        if notes:
            doc.sections.append(Section("Warnings and notes", items=notes))
    if audit.validation is not None:
        doc.summary.append("Validation: " + ("matches eager." if audit.validation.get("ok") else "DIFFERS from eager."))
        doc.sections.append(_validation_section(audit.validation))
    return doc


# -- writers ------------------------------------------------------------------------------------------------


# Line breaks and other control characters, and lone surrogates (an undecodable byte of a file name, as Python
# reads it): shown as their escapes (`\n`, `\x1b`, `\udcff`), so a text is one line and every report writes.
_UNPRINTABLE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")
# What starts inline Markdown anywhere in a line: code, emphasis, HTML and autolinks, entities, strikethrough,
# an inline link or image (`](`); `_` only where it can (not inside a word such as `opset_version`). A bracket
# alone is text: a reference link needs a definition, which only a line's start could hold (`_MD_BLOCK`).
_MD_INLINE = re.compile(r"[\\`*<~]|\](?=\()|&(?=#?[0-9A-Za-z]+;)|(?<![0-9A-Za-z])_|_(?![0-9A-Za-z])")
# What starts a block at the beginning of a line (heading, quote, list item, rule, table, setext underline, a
# link definition); a numbered item's digits are followed by `.` or `)`, which is what is escaped.
_MD_BLOCK = re.compile(r"^(?:[#>+=|\[-]|\d+(?=[.)]))")


def visible(text: str) -> str:
    """`text` on one line: each control character, line break or lone surrogate as its backslash escape."""
    return _UNPRINTABLE.sub(lambda m: m.group().encode("unicode_escape", "backslashreplace").decode("ascii"), text)


def _md_text(text: str) -> str:
    """`text` as Markdown that renders as exactly that text, on one line: a value from a model, a path or an error
    (a newline in a class name, a `#`, a `<script>`) can neither start a line nor become markup."""
    escaped = _MD_INLINE.sub(lambda m: "\\" + m.group(), text)
    # Control characters after the inline escapes: the backslash of `\n` is then shown, not read as an escape.
    escaped = _UNPRINTABLE.sub(lambda m: "\\" + visible(m.group()), escaped)
    escaped = _MD_BLOCK.sub(lambda m: m.group() + "\\" if m.group()[0].isdigit() else "\\" + m.group(), escaped)
    escaped = re.sub(r"#+$", lambda m: "\\#" * len(m.group()), escaped)  # a heading's closing hashes
    leading = len(escaped) - len(escaped.lstrip(" \t"))  # indentation would make a code block
    return "".join(f"&#{ord(c)};" for c in escaped[:leading]) + escaped[leading:]


def _md_cell(text: str) -> str:
    # A pipe ends a cell and a newline ends the row: a newline becomes a line break inside the cell.
    lines = re.split(r"\r\n|\r|\n", text)
    return "<br>".join(_md_text(line).replace("|", "\\|") for line in lines)


def to_markdown(doc: Document) -> str:
    lines = [f"# {_md_text(doc.title)}", ""]
    lines += [f"- {_md_text(line)}" for line in doc.summary]
    for section in doc.sections:
        lines += ["", f"## {_md_text(section.title)}", ""]
        lines += [_md_text(p) + "\n" for p in section.paragraphs]
        lines += [f"- {_md_text(item)}" for item in section.items]
        if section.table:
            lines.append("| " + " | ".join(_md_cell(h) for h in section.table.headers) + " |")
            lines.append("|" + "---|" * len(section.table.headers))
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in section.table.rows]
    return "\n".join(lines).rstrip() + "\n"


_CSS = """
body { font-family: system-ui, sans-serif; font-size: 14px; margin: 1.5em; color: #222; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; margin: 0.5em 0; max-width: 100%; }
th, td { border: 1px solid #ccc; padding: 3px 7px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; }
td { max-width: 38em; overflow-wrap: anywhere; }
td.n { white-space: nowrap; overflow-wrap: normal; }
tr.fired td { background: #e3f1ff; }
tr.ok td { background: #e2f4e2; }
tr.fail td { background: #f8d7d7; }
ul.summary { font-size: 1.05em; }
details.folded { margin-top: 1.6em; border-bottom: 1px solid #ddd; }
details.folded > summary { font-size: 1.15em; font-weight: bold; cursor: pointer; }
tr.skip td { background: #f3f3f3; }
"""


_NOWRAP = {"rule", "stage", "kind", "hits", "status", "seconds", "output", "shape", "setting", "package"}


def to_html(doc: Document) -> str:
    def e(text: str) -> str:
        return html.escape(visible(text))

    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        # No network: a policy that allows only the inline style, so a report can never fetch anything.
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\">",
        f"<title>{e(doc.title)}</title><style>{_CSS}</style></head><body>",
        f"<h1>{e(doc.title)}</h1>",
        '<ul class="summary">' + "".join(f"<li>{e(line)}</li>" for line in doc.summary) + "</ul>",
    ]
    for section in doc.sections:
        if section.folded:
            parts.append(f'<section><details class="folded"><summary>{e(section.title)}</summary>')
        else:
            parts.append(f"<section><h2>{e(section.title)}</h2>")
        parts += [f"<p>{e(p)}</p>" for p in section.paragraphs]
        if section.items:
            parts.append("<ul>" + "".join(f"<li>{e(item)}</li>" for item in section.items) + "</ul>")
        if section.table:
            table = section.table
            parts.append("<table><thead><tr>" + "".join(f"<th>{e(h)}</th>" for h in table.headers) + "</tr></thead>")
            parts.append("<tbody>")
            # Short columns (ids, counts, verdicts) never wrap; prose columns wrap anywhere so the table fits.
            cell = ['<td class="n">' if h in _NOWRAP else "<td>" for h in table.headers]
            for i, row in enumerate(table.rows):
                css = table.row_classes[i] if i < len(table.row_classes) else ""
                attr = f' class="{css}"' if css else ""
                parts.append(f"<tr{attr}>" + "".join(f"{cell[j]}{e(c)}</td>" for j, c in enumerate(row)) + "</tr>")
            parts.append("</tbody></table>")
        parts.append("</details></section>" if section.folded else "</section>")
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def render(doc: Document, render_format: str) -> str:
    """`doc` as "markdown" or "html"."""
    if render_format == "markdown":
        return to_markdown(doc)
    if render_format == "html":
        return to_html(doc)
    raise ValueError(f"render format must be one of {RENDER_FORMATS}, got {render_format!r}")


def write_documents(doc: Document, targets: Sequence[tuple[str, str | None]]) -> list[str]:
    """Write `doc` to each (render format, path) whose path is set; return the paths written."""
    from pathlib import Path

    from hfexport.core.files import write_text_atomically

    written = []
    for render_format, path in targets:
        if path:
            # backslashreplace: a report is written whatever its text holds (every text is `visible` already).
            write_text_atomically(Path(path), render(doc, render_format), errors="backslashreplace")
            written.append(path)
    return written
