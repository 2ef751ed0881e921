"""Write docs/coverage.md's release-wide table from the sweeps of the generated corpus (issue #17).

    python tools/coverage_report.py                 # reads docs/sweeps/*.json, rewrites docs/coverage.md
    python tools/coverage_report.py --check         # exit 1 if docs/coverage.md is stale

Inputs, all under ``docs/sweeps/``:

- ``<format>_<family>.json`` or ``<format>_<family>.<part>.json``: the ``--json`` of ``hfexport sweep --configs
  tests/fixtures/corpus_all/<family> --format <format>`` (one family per file; the parts of a family swept in
  several runs are merged; a subset of the family is fine, see ``meta.json``);
- ``meta.json``: when and how the sweeps ran: ``date``, ``load`` (the machine's load, in words), ``command``,
  ``subsets`` (format -> family -> a sentence saying which entries were swept), ``targets`` (family -> format ->
  the pass rate the issue asks for, in percent);
- ``subset40.json``: ``families`` (family -> entries): the architecture subset ExecuTorch and OpenVINO are judged on
  (a line per format under the table: how many of the subset pass, out of its size);
- ``causes.json``: the triage: ``causes`` (cause id -> one line: the error, the code pattern in transformers
  that causes it) and ``rows`` (``"<format>:<family>/<type>"`` or ``"<family>/<type>"`` for every format ->
  cause id). A failure without a cause is listed as untriaged with its error.

The per-family counts of types in transformers' mappings and of built entries come from the corpus folders
(``tests/fixtures/corpus_all/<family>``: its entries, and ``_skipped.json`` for what could not be built).
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SWEEPS = ROOT / "docs" / "sweeps"
CORPUS = ROOT / "tests" / "fixtures" / "corpus_all"
COVERAGE = ROOT / "docs" / "coverage.md"
START, END = "<!-- sweep:start -->", "<!-- sweep:end -->"
FORMATS = ("dynamo", "onnx", "executorch", "openvino")
# The families the issue sets targets for first, then the rest by name.
FIRST = ("causal_lm", "encoder", "seq2seq", "vlm")
# Issue #17: ExecuTorch and OpenVINO pass this share of the architecture subset (docs/sweeps/subset40.json).
SUBSET_TARGET = 90


@dataclass
class FamilyRun:
    """One family swept to one format: the corpus counts and the sweep's rows."""

    family: str
    export_format: str
    in_mapping: int
    built: int
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def passed(self) -> int:
        return sum(1 for r in self.rows if r["status"] == "ok")

    @property
    def failures(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["status"] != "ok"]


def corpus_counts(family: str, corpus: Path = CORPUS) -> tuple[int, int]:
    """(types in transformers' mapping, entries built) for one family of the generated corpus."""
    folder = corpus / family
    built = sum(1 for p in folder.glob("*.json") if not p.name.startswith("_"))
    skipped_file = folder / "_skipped.json"
    skipped = len(json.loads(skipped_file.read_text())) if skipped_file.exists() else 0
    return built + skipped, built


def _entry(row: dict[str, Any]) -> str:
    return row["model_type"] or row["model"].rpartition("/")[2]


def load_runs(sweeps: Path = SWEEPS, corpus: Path = CORPUS) -> list[FamilyRun]:
    """Every ``<format>_<family>.json`` under `sweeps`, in format then family order.

    The files `meta.json` lists under `reruns` (re-sweeps after a fix) are read last, in that order, and their
    rows replace the earlier rows of the same entry."""
    meta_file = sweeps / "meta.json"
    reruns = json.loads(meta_file.read_text()).get("reruns", []) if meta_file.exists() else []
    paths = sorted(p for p in sweeps.glob("*_*.json") if p.name not in reruns)
    paths += [sweeps / name for name in reruns if (sweeps / name).exists()]
    runs: dict[tuple[str, str], FamilyRun] = {}
    for path in paths:
        # `<format>_<family>.json`, or `<format>_<family>.<part>.json` for a family swept in several runs.
        export_format, _, family = path.name.split(".")[0].partition("_")
        if export_format not in FORMATS or not (corpus / family).is_dir():
            continue
        if (export_format, family) not in runs:
            runs[export_format, family] = FamilyRun(family, export_format, *corpus_counts(family, corpus))
        run = runs[export_format, family]
        new = json.loads(path.read_text())["rows"]
        replaced = {_entry(row) for row in new} if path.name in reruns else set()
        run.rows = [row for row in run.rows if _entry(row) not in replaced] + new

    def order(run: FamilyRun) -> tuple[int, int, str]:
        first = FIRST.index(run.family) if run.family in FIRST else len(FIRST)
        return FORMATS.index(run.export_format), first, run.family

    return sorted(runs.values(), key=order)


def cause_of(row: dict[str, Any], run: FamilyRun, causes: dict[str, Any]) -> str | None:
    """The triaged cause id of a failed row: the format-specific key first, then the family/type key."""
    name = f"{run.family}/{row['model_type'] or row['model'].rpartition('/')[2]}"
    by_row = causes.get("rows", {})
    return by_row.get(f"{run.export_format}:{name}") or by_row.get(name)


def _one_line(text: str, width: int = 160) -> str:
    text = " ".join(text.replace("|", "/").split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _fill(text: str, indent: str = "") -> str:
    return textwrap.fill(text, 116, subsequent_indent=indent, break_on_hyphens=False, break_long_words=False)


def _pct(n: int, d: int) -> str:
    return f"{100 * n / d:.0f} %" if d else "-"


def subset_summary(runs: list[FamilyRun], subset: dict[str, list[str]], target: int = SUBSET_TARGET) -> list[str]:
    """Lines counting, per format other than Dynamo and ONNX, the rows of the architecture subset (`subset`:
    family -> entries) that pass, out of the subset's size: issue #17 judges ExecuTorch and OpenVINO on it."""
    if not subset:
        return []
    size = sum(len(names) for names in subset.values())
    lines = [""]
    for export_format in FORMATS[2:]:
        rows = [
            row
            for run in runs
            if run.export_format == export_format
            for row in run.rows
            if _entry(row) in subset.get(run.family, ())
        ]
        passed = sum(1 for row in rows if row["status"] == "ok")
        verdict = "met" if 100 * passed >= target * size else "not met"
        unswept = f"; {size - len(rows)} not swept" if len(rows) < size else ""
        lines.append(
            f"- {export_format} on the {size}-architecture subset (`docs/sweeps/subset40.json`): {passed} of {size} "
            f"pass ({_pct(passed, size)}; {len(rows)} swept{unswept}), target {target} % ({verdict})."
        )
    return lines


def render(
    runs: list[FamilyRun], meta: dict[str, Any], causes: dict[str, Any], subset: dict[str, list[str]] | None = None
) -> str:
    """The generated block of docs/coverage.md: the pass-rate table, the architecture subset's counts, the causes
    with counts, every failure."""
    subset = subset or {}
    targets = meta.get("targets", {})
    lines = [
        START,
        "## Release-wide sweep of the generated corpus",
        "",
        _fill(
            f"Measured on {meta.get('date', '?')}, torch 2.13.0 CPU, transformers 5.24.0, with "
            f"`{meta.get('command', '')}`, one process per entry: export with `dynamic=True`, save, load, run in "
            "the format's runtime and compare the entry's main output with eager on the sample, 13, 73 and 138 "
            "tokens and batch+1 (the shapes eager accepts). Machine: " + meta.get("load", "?")
        ),
        "",
        _fill(
            "Swept = the entries the sweep ran (a documented subset where time did not allow the whole family: "
            "see the list under the table); pass % and the issue's target are judged on the swept entries only. "
            "Generated by `python tools/coverage_report.py` from `docs/sweeps/` (do not edit this block by hand)."
        ),
        "",
        "| family | backend | types in transformers | built | swept | pass | pass % | target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        target = targets.get(run.family, {}).get(run.export_format)
        verdict = ""
        if target is not None and run.rows:
            verdict = f"{target} % ({'met' if 100 * run.passed >= target * len(run.rows) else 'not met'})"
        lines.append(
            f"| {run.family} | {run.export_format} | {run.in_mapping} | {run.built} | {len(run.rows)} | "
            f"{run.passed} | {_pct(run.passed, len(run.rows))} | {verdict} |"
        )
    lines += subset_summary(runs, subset)
    subsets = meta.get("subsets", {})
    lines += ["", "Entries swept:", ""]
    for run in runs:
        how = subsets.get(run.export_format, {}).get(run.family, "")
        names = ", ".join(sorted(r["model_type"] or r["model"] for r in run.rows))
        lines.append(_fill(f"- {run.export_format} {run.family}{f' ({how})' if how else ''}: {names}.", "  "))
    # Causes with their counts (each failure once per format), then every failure under its cause.
    grouped: dict[str, list[str]] = defaultdict(list)
    untriaged: list[str] = []
    for run in runs:
        for row in run.failures:
            model = row["model_type"] or row["model"]
            cause = cause_of(row, run, causes)
            label = f"{run.export_format}: {run.family}/{model}"
            if cause:
                grouped[cause].append(label)
            else:
                untriaged.append(f"{label} ({row['status']}): {_one_line(row.get('error', ''))}")
    texts = causes.get("causes", {})
    counts = Counter({cause: len(models) for cause, models in grouped.items()})
    lines += ["", "### Failures by cause", ""]
    if not grouped and not untriaged:
        lines.append("None.")
    for cause, count in counts.most_common():
        models = ", ".join(sorted(grouped[cause]))
        lines.append(_fill(f"- **{cause}** ({count}): {texts.get(cause, '')} Models: {models}.", "  "))
    if untriaged:
        lines += ["", "Not triaged yet (the sweep's error):", ""]
        lines += [_fill(f"- {line}", "  ") for line in untriaged]
    lines.append(END)
    return "\n".join(lines)


def rewrite(text: str, block: str) -> str:
    """`text` with the generated block replaced (or appended after the title when it has none)."""
    if START in text and END in text:
        return text[: text.index(START)] + block + text[text.index(END) + len(END) :]
    head, _, rest = text.partition("\n")
    return f"{head}\n\n{block}\n{rest}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweeps", type=Path, default=SWEEPS)
    parser.add_argument("--corpus", type=Path, default=CORPUS)
    parser.add_argument("--out", type=Path, default=COVERAGE)
    parser.add_argument("--check", action="store_true", help="exit 1 if the doc differs from what it would write")
    args = parser.parse_args(argv)
    read = lambda name: json.loads((args.sweeps / name).read_text()) if (args.sweeps / name).exists() else {}  # noqa: E731
    subset = read("subset40.json").get("families", {})
    block = render(load_runs(args.sweeps, args.corpus), read("meta.json"), read("causes.json"), subset)
    current = args.out.read_text() if args.out.exists() else "# Architecture coverage\n"
    updated = rewrite(current, block)
    if args.check:
        if updated != current:
            print(f"{args.out} is stale: run `python tools/coverage_report.py`", file=sys.stderr)
            return 1
        return 0
    args.out.write_text(updated)
    print(block)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
