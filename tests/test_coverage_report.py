"""docs/coverage.md's release-wide table is generated from the sweeps in docs/sweeps/ (hfexport.apps.docgen.coverage,
written by tools/coverage_report.py)."""

from __future__ import annotations

import json
from pathlib import Path

from hfexport.apps.docgen import coverage as report
from hfexport.apps.docgen.coverage_runs import load_runs

ROOT = Path(__file__).resolve().parents[1]


def _row(model_type: str, status: str, error: str = "") -> dict[str, object]:
    return {"model": f"fam/{model_type}", "model_type": model_type, "status": status, "error": error}


def test_report_counts_pass_rates_and_groups_failures_by_cause(tmp_path: Path) -> None:
    corpus, sweeps = tmp_path / "corpus", tmp_path / "sweeps"
    (corpus / "fam").mkdir(parents=True)
    sweeps.mkdir()
    for name in ("a", "b", "c", "d"):
        (corpus / "fam" / f"{name}.json").write_text("{}")
    (corpus / "fam" / "_skipped.json").write_text(json.dumps({"e": "too big", "f": "no input"}))
    rows = [_row("a", "ok"), _row("b", "grown-run-error", "Guard failed"), _row("c", "export-error", "boom")]
    (sweeps / "dynamo_fam.part0.json").write_text(json.dumps({"rows": rows[:2]}))
    (sweeps / "dynamo_fam.part1.json").write_text(json.dumps({"rows": rows[2:]}))
    (sweeps / "onnx_fam.json").write_text(json.dumps({"rows": rows[:1]}))
    runs = load_runs(sweeps, corpus, tmp_path / "variants")
    assert [(r.export_format, r.in_mapping, r.built, len(r.rows), r.passed) for r in runs] == [
        ("dynamo", 6, 4, 3, 1),
        ("onnx", 6, 4, 1, 1),
    ]
    meta = {"machine": "here", "targets": {"fam": {"dynamo": 50, "onnx": 15}}}
    causes = {"causes": {"baked-length": "a guard on the traced length."}, "rows": {"dynamo:fam/b": "baked-length"}}
    block = report.render(runs, meta, causes, corpus=corpus, variants=tmp_path / "variants")
    # Passed out of every type in transformers: the 2 types never built count as not passed.
    assert "| fam | dynamo | 6 | 4 | 3 | 1 | 17 % | 0 | 0 | 0 | 50 % (not met) |" in block
    assert "| fam | onnx | 6 | 4 | 1 | 1 | 17 % | 0 | 0 | 0 | 15 % (met) |" in block
    assert "**baked-length** (1): a guard on the traced length. Models: dynamo: fam/b." in block
    # An untriaged failure is listed with the sweep's own error, never dropped.
    assert "dynamo: fam/c (export-error): boom" in block
    assert report.rewrite("# T\n\nold\n", block).startswith("# T\n\n" + report.START)
    # The architecture subset is counted out of its size, entries not swept included.
    (sweeps / "openvino_fam.json").write_text(json.dumps({"rows": rows}))
    subset = {"fam": ["a", "b", "d"]}
    lines = report.subset_summary(load_runs(sweeps, corpus, tmp_path / "variants"), subset, target=60)
    expected = "1 of 3 pass (33 %; 2 swept; 1 not swept), target 60 % (not met)."
    assert "- openvino on the 3-architecture subset (`docs/sweeps/subset40.json`): " + expected in lines
    assert any(line.startswith("- executorch on the 3-architecture subset") and "0 swept" in line for line in lines)
    # Every registered backend's sweep files count (AOTInductor's too), in the registry's order.
    (sweeps / "aoti_fam.sub.json").write_text(json.dumps({"rows": rows[:1]}))
    runs = load_runs(sweeps, corpus, tmp_path / "variants")
    assert [r.export_format for r in runs] == ["dynamo", "onnx", "openvino", "aoti"]
    lines = report.subset_summary(runs, subset, target=60)
    assert "- aoti on the 3-architecture subset (`docs/sweeps/subset40.json`): 1 of 3 pass" in "\n".join(lines)


def test_coverage_doc_is_current() -> None:
    current = (ROOT / "docs" / "coverage.md").read_text()
    fixtures = ROOT / "tests" / "fixtures"
    updated = report.update(current, ROOT / "docs" / "sweeps", fixtures / "corpus_all", fixtures / "corpus_variants")
    assert updated == current, "docs/coverage.md is stale: run `python tools/coverage_report.py`"


def test_a_rerun_listed_in_meta_replaces_the_entry_s_earlier_rows(tmp_path: Path) -> None:
    corpus, sweeps = tmp_path / "corpus", tmp_path / "sweeps"
    (corpus / "fam").mkdir(parents=True)
    sweeps.mkdir()
    for name in ("a", "b"):
        (corpus / "fam" / f"{name}.json").write_text("{}")
    (sweeps / "dynamo_fam.json").write_text(json.dumps({"rows": [_row("a", "ok"), _row("b", "grown-run-error")]}))
    # Sorts before the first file by name: only the meta's order makes it the later run.
    (sweeps / "dynamo_fam.0fix.json").write_text(json.dumps({"rows": [_row("b", "ok")]}))
    # Not listed: both rows of b count.
    assert [(len(r.rows), r.passed) for r in load_runs(sweeps, corpus, tmp_path / "variants")] == [(3, 2)]
    (sweeps / "meta.json").write_text(json.dumps({"reruns": ["dynamo_fam.0fix.json"]}))
    assert [(len(r.rows), r.passed) for r in load_runs(sweeps, corpus, tmp_path / "variants")] == [(2, 2)]


def test_variant_rows_are_counted_apart_from_the_types(tmp_path: Path) -> None:
    corpus, sweeps, variants = tmp_path / "corpus", tmp_path / "sweeps", tmp_path / "variants"
    (corpus / "fam").mkdir(parents=True)
    (variants / "fam").mkdir(parents=True)
    sweeps.mkdir()
    (corpus / "fam" / "a.json").write_text("{}")
    for name in ("a@sliding_window=3", "a@many-experts"):
        (variants / "fam" / f"{name}.json").write_text("{}")
    rows = [
        _row("a", "ok"),
        {"model": "fam/a@sliding_window=3", "model_type": "a", "status": "grown-run-error", "error": "Guard"},
    ]
    (sweeps / "dynamo_fam.json").write_text(json.dumps({"rows": rows}))
    (run,) = load_runs(sweeps, corpus, variants)
    assert (run.passed, len(run.type_rows), run.variants_built, len(run.variant_rows), run.passed_variants) == (
        1,
        1,
        2,
        1,
        0,
    )
    coverage = {"a": {"sides": 4, "covered_by_entry": 1, "covered": 3, "variants": ["x", "y"], "skipped": {"z": "no"}}}
    (variants / "fam" / "_coverage.json").write_text(json.dumps(coverage))
    block = report.render([run], {}, {}, corpus=corpus, variants=variants)
    assert "| fam | dynamo | 1 | 1 | 1 | 1 | 100 % | 2 | 1 | 0 |  |" in block
    assert "| fam | 1 | 2 | 1 | 4 | 1 (25 %) | 3 (75 %) |" in block
    assert "dynamo: fam/a@sliding_window=3 (grown-run-error): Guard" in block
