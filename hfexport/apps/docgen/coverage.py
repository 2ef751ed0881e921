"""docs/coverage.md's release-wide table, generated from the sweeps of the generated corpus.

`tools/coverage_report.py` writes (or `--check`s) the file from this checkout's folders. Inputs, all under
``docs/sweeps/``:

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
(``tests/fixtures/corpus_all/<family>``: its entries, and ``_skipped.json`` for what could not be built); a type
not built counts as not passed. Rows of variants (``<type>@<variant>``, the entries of
``tests/fixtures/corpus_variants/<family>``, made by tools/gen_variants.py) are counted apart from the types', and
that folder's ``_coverage.json`` gives the branch coverage of the variants. Generation parity comes from
``docs/sweeps/generation/<format>_<family>.<part>.json`` (the ``--json`` of ``hfexport sweep --generation``, or a
list of such rows; later parts replace a model's earlier rows).
"""

from __future__ import annotations

import json
import textwrap
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from hfexport.apps.docgen.coverage_runs import (
    FORMATS,
    FamilyRun,
    corpus_counts,
    entry_name,
    load_generation,
    load_runs,
    variants_built,
)

START, END = "<!-- sweep:start -->", "<!-- sweep:end -->"
# Issue #17: ExecuTorch and OpenVINO pass this share of the architecture subset (docs/sweeps/subset40.json).
SUBSET_TARGET = 90


def cause_of(row: dict[str, Any], run: FamilyRun, causes: dict[str, Any]) -> str | None:
    """The triaged cause id of a failed row: the format-specific key first, then the family/type key."""
    name = f"{run.family}/{entry_name(row)}"
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
            if entry_name(row) in subset.get(run.family, ())
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
    runs: list[FamilyRun],
    meta: dict[str, Any],
    causes: dict[str, Any],
    subset: dict[str, list[str]] | None = None,
    generation: dict[tuple[str, str], dict[str, dict[str, Any]]] | None = None,
    *,
    corpus: Path,
    variants: Path,
) -> str:
    """The generated block of docs/coverage.md: the pass-rate table, the architecture subset's counts, the causes
    with counts, every failure."""
    subset = subset or {}
    targets = meta.get("targets", {})
    lines = [
        START,
        "## Every type of transformers on every backend",
        "",
        "| family | backend | types in transformers | built | swept | passed | pass % of types | variants built "
        "| variants swept | variants passed | target |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for run in runs:
        target = targets.get(run.family, {}).get(run.export_format)
        verdict = ""
        if target is not None:
            verdict = f"{target} % ({'met' if 100 * run.passed >= target * run.in_mapping else 'not met'})"
        lines.append(
            f"| {run.family} | {run.export_format} | {run.in_mapping} | {run.built} | {len(run.type_rows)} | "
            f"{run.passed} | {_pct(run.passed, run.in_mapping)} | {run.variants_built} | {len(run.variant_rows)} | "
            f"{run.passed_variants} | {verdict} |"
        )
    # The table first (what is true now), then what its columns mean and how it was measured.
    lines += [
        "",
        _fill(
            "Types = every `model_type` of the family's auto mappings; a type the generator could not build, or one "
            "not swept on that backend, counts as not passed, so `pass % of types` is passed / types in transformers"
            " and is what the target is judged on. Variants are counted apart: built, swept, passed. Generated by "
            "`python tools/coverage_report.py` from `docs/sweeps/` (do not edit this block by hand)."
        ),
        "",
        _fill(
            "torch 2.13.0 CPU, transformers 5.24.0. Each entry (a tiny config of one model type, or a variant: the "
            "same type with one config attribute its code branches on set otherwise) is swept with "
            f"`{meta.get('command', '')}`, one process per entry: export with `dynamic=True`, save, load, run in "
            "the format's runtime and compare the entry's main output with eager on the sample, 13, 73 and 138 "
            "tokens and batch+1. Machine: " + meta.get("machine", meta.get("load", "?"))
        ),
    ]
    lines += subset_summary(runs, subset)
    subsets = meta.get("subsets", {})
    lines += ["", "Entries swept:", ""]
    for run in runs:
        how = subsets.get(run.export_format, {}).get(run.family, "")
        names = ", ".join(sorted(entry_name(r) for r in run.rows))
        lines.append(_fill(f"- {run.export_format} {run.family}{f' ({how})' if how else ''}: {names}.", "  "))
    # Causes with their counts (each failure once per format), then every failure under its cause.
    grouped: dict[str, list[str]] = defaultdict(list)
    untriaged: list[str] = []
    for run in runs:
        for row in run.failures:
            model = entry_name(row)
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
    lines += render_variants(variants)
    lines += render_generation(generation or {}, meta.get("generation_targets", {}), corpus)
    lines += render_durations(runs, corpus, variants)
    lines.append(END)
    return "\n".join(lines)


GENERATIVE = ("causal_lm", "seq2seq", "vlm", "speech_seq2seq")
CLUSTER_WORKERS = 64  # the cluster the release-wide estimate is given for: one case per worker CPU


def render_generation(
    gen: dict[tuple[str, str], dict[str, dict[str, Any]]], targets: dict[str, Any], corpus: Path
) -> list[str]:
    """The generation-parity table: equal tokens out of the generative types in transformers."""
    lines = [
        "",
        "### Generation token parity",
        "",
        _fill(
            "`hfexport sweep --generation --configs tests/fixtures/corpus_all/<family> --format <format> "
            "--json docs/sweeps/generation/<format>_<family>.<part>.json`: `export_for_generation(dynamic=True)`, "
            "then 8 greedy tokens with `hfexport.runtime.generate` from a left-padded batch of 2 against the model's "
            "own `generate`; equal = every token equal. Types not built or not measured count as not equal."
        ),
        "",
        "| family | backend | types in transformers | built | measured | equal | equal % of types | target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for export_format in FORMATS:
        for family in GENERATIVE:
            rows = gen.get((export_format, family))
            if not rows:
                continue
            in_mapping, built = corpus_counts(family, corpus)
            equal = sum(1 for r in rows.values() if r["status"] == "ok")
            target = targets.get(export_format)
            verdict = f"{target} % ({'met' if 100 * equal >= target * in_mapping else 'not met'})" if target else ""
            lines.append(
                f"| {family} | {export_format} | {in_mapping} | {built} | {len(rows)} | {equal} | "
                f"{_pct(equal, in_mapping)} | {verdict} |"
            )
    failed = [
        f"- {export_format}: {family}/{model} ({row['status']}): {_one_line(row.get('error', ''), 140)}"
        for (export_format, family), rows in sorted(gen.items())
        for model, row in sorted(rows.items())
        if row["status"] != "ok"
    ]
    if failed:
        lines += ["", "Not equal (the sweep's status and error; causes in [causes.md](causes.md)):", ""]
        lines += [_fill(line, "  ") for line in failed]
    return lines


def render_variants(variants: Path) -> list[str]:
    """Per family: variants built and the sides of the config `if`s the entries and their variants take."""
    lines = [
        "",
        "### Config variants and the branches they take",
        "",
        _fill(
            "`python tools/gen_variants.py --families <family>` proposes, for each built entry, configs that take "
            "the other side of the branches its modeling code has on config attributes "
            "(`hfexport/testing/corpus_variants.py`), checks each in eager and measures, under a line tracer, "
            "which sides of the config-reading `if`s of the type's modeling files and of transformers' mask and "
            "cache code run (`hfexport/testing/config_branches.py`). Per type: "
            "`tests/fixtures/corpus_variants/<family>/README.md`."
        ),
        "",
        "| family | types measured | variants built | proposed, not built | if sides reached | taken by the entries "
        "| taken with the variants |",
        "|---|---|---|---|---|---|---|",
    ]
    found = False
    for folder in sorted(variants.glob("*/_coverage.json")) if variants.is_dir() else []:
        data = json.loads(folder.read_text())
        rows = [v for v in data.values() if "covered" in v]
        if not rows:
            continue
        found = True
        sides = sum(v["sides"] for v in rows)
        entry = sum(v["covered_by_entry"] for v in rows)
        covered = sum(v["covered"] for v in rows)
        lines.append(
            f"| {folder.parent.name} | {len(rows)} | {sum(len(v['variants']) for v in rows)} | "
            f"{sum(len(v['skipped']) for v in rows)} | {sides} | {entry} ({_pct(entry, sides)}) | "
            f"{covered} ({_pct(covered, sides)}) |"
        )
    return lines if found else []


def render_durations(runs: list[FamilyRun], corpus: Path, variants: Path) -> list[str]:
    """Measured time per case per backend, and what a release-wide sweep of every entry would take."""
    # The corpus counts are the family's whatever the format: each family swept counts once.
    entries = sum({run.family: run.built + run.variants_built for run in runs}.values())
    if not entries:
        entries = sum(
            corpus_counts(f.name, corpus)[1] + variants_built(f.name, variants) for f in corpus.iterdir() if f.is_dir()
        )
    lines = [
        "",
        "### Sweep durations",
        "",
        "| backend | cases measured | their wall time (h) | mean s per case "
        f"| every built entry and variant, one process (h) | on {CLUSTER_WORKERS} workers (h) |",
        "|---|---|---|---|---|---|",
    ]
    total = 0.0
    for export_format in FORMATS:
        walls = [float(r.get("wall_s") or 0) for run in runs if run.export_format == export_format for r in run.rows]
        walls = [w for w in walls if w > 0]
        if not walls:
            continue
        mean = sum(walls) / len(walls)
        release = entries * mean / 3600
        total += release
        lines.append(
            f"| {export_format} | {len(walls)} | {sum(walls) / 3600:.1f} | {mean:.0f} | {release:.0f} | "
            f"{release / CLUSTER_WORKERS:.1f} |"
        )
    lines += [
        "",
        _fill(
            f"A release-wide sweep is {entries} entries (built types and variants of every family) on each backend: "
            f"about {total:.0f} h in one process here, {total / CLUSTER_WORKERS:.1f} h on {CLUSTER_WORKERS} Ray "
            "workers (`hfexport sweep --ray ADDRESS`, one case per task), from the mean time per case measured on "
            "this shared 2-core machine (a case on a dedicated core is faster)."
        ),
    ]
    return lines


def rewrite(text: str, block: str) -> str:
    """`text` with the generated block replaced (or appended after the title when it has none)."""
    if START in text and END in text:
        return text[: text.index(START)] + block + text[text.index(END) + len(END) :]
    head, _, rest = text.partition("\n")
    return f"{head}\n\n{block}\n{rest}"


def update(current: str, sweeps: Path, corpus: Path, variants: Path) -> str:
    """`current` (docs/coverage.md's text) with its generated block made from the sweeps under `sweeps`, the corpus
    folders under `corpus` and the variants under `variants`."""

    def read(name: str) -> dict[str, Any]:
        return json.loads((sweeps / name).read_text()) if (sweeps / name).exists() else {}

    subset = read("subset40.json").get("families", {})
    runs = load_runs(sweeps, corpus, variants)
    generation = load_generation(sweeps / "generation", corpus)
    block = render(runs, read("meta.json"), read("causes.json"), subset, generation, corpus=corpus, variants=variants)
    return rewrite(current, block)
