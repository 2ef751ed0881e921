"""The sweep records docs/coverage.md is made from (`hfexport.apps.docgen.coverage`): each family's rows per format
(`load_runs`, reruns listed in `meta.json` replacing earlier rows), the corpus counts they are judged against, and
the generation parity rows (`load_generation`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hfexport.backends import names

# Every registered backend, in the registry's order: a sweep file `<format>_<family>.*.json` of any of them counts.
FORMATS: tuple[str, ...] = names()
# The families the issue sets targets for first, then the rest by name.
FIRST = ("causal_lm", "encoder", "seq2seq", "vlm")


@dataclass
class FamilyRun:
    """One family swept to one format: the corpus counts and the sweep's rows (types' and variants')."""

    family: str
    export_format: str
    in_mapping: int
    built: int
    rows: list[dict[str, Any]] = field(default_factory=list)
    variants_built: int = 0

    @property
    def type_rows(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if "@" not in entry_name(r)]

    @property
    def variant_rows(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if "@" in entry_name(r)]

    @property
    def passed(self) -> int:
        """Types (not variants) that pass."""
        return sum(1 for r in self.type_rows if r["status"] == "ok")

    @property
    def passed_variants(self) -> int:
        return sum(1 for r in self.variant_rows if r["status"] == "ok")

    @property
    def failures(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["status"] != "ok"]


def corpus_counts(family: str, corpus: Path) -> tuple[int, int]:
    """(types in transformers' mapping, entries built) for one family of the generated corpus."""
    folder = corpus / family
    built = sum(1 for p in folder.glob("*.json") if not p.name.startswith("_"))
    skipped_file = folder / "_skipped.json"
    skipped = len(json.loads(skipped_file.read_text())) if skipped_file.exists() else 0
    return built + skipped, built


def entry_name(row: dict[str, Any]) -> str:
    """The row's entry: ``type`` or ``type@variant``."""
    name = str(row["model"]).rpartition("/")[2]
    return name if "@" in name else (row.get("model_type") or name)


def variants_built(family: str, variants: Path) -> int:
    """Variant entries of a family (tests/fixtures/corpus_variants/<family>/<type>@<variant>.json)."""
    return sum(1 for p in (variants / family).glob("*@*.json")) if (variants / family).is_dir() else 0


def load_runs(sweeps: Path, corpus: Path, variants: Path) -> list[FamilyRun]:
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
            runs[export_format, family] = FamilyRun(
                family, export_format, *corpus_counts(family, corpus), variants_built=variants_built(family, variants)
            )
        run = runs[export_format, family]
        new = json.loads(path.read_text())["rows"]
        replaced = {entry_name(row) for row in new} if path.name in reruns else set()
        run.rows = [row for row in run.rows if entry_name(row) not in replaced] + new

    def order(run: FamilyRun) -> tuple[int, int, str]:
        first = FIRST.index(run.family) if run.family in FIRST else len(FIRST)
        return FORMATS.index(run.export_format), first, run.family

    return sorted(runs.values(), key=order)


def load_generation(root: Path, corpus: Path) -> dict[tuple[str, str], dict[str, dict[str, Any]]]:
    """``{(format, family): {model: row}}`` from ``<format>_<family>.<part>.json`` lists of rows, in name order,
    a later part replacing a model's earlier row; static-cache parts (``static`` in the part) are another mode
    and left out."""
    out: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for path in sorted(root.glob("*_*.*.json")) if root.is_dir() else []:
        stem, _, part = path.name.removesuffix(".json").partition(".")
        export_format, _, family = stem.partition("_")
        if export_format not in FORMATS or not (corpus / family).is_dir() or "static" in part:
            continue
        rows = json.loads(path.read_text())
        rows = rows.get("rows", []) if isinstance(rows, dict) else rows
        for row in rows:
            # `hfexport sweep` names a row `family/type`: the table keys it by the type (`type@variant`).
            out.setdefault((export_format, family), {})[str(row["model"]).rpartition("/")[2]] = row
    return out
