"""docs/coverage.md's release-wide table is generated from the sweeps in docs/sweeps/ (tools/coverage_report.py)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("coverage_report", ROOT / "tools" / "coverage_report.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["coverage_report"] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


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
    tool = _tool()
    runs = tool.load_runs(sweeps, corpus)
    assert [(r.export_format, r.in_mapping, r.built, len(r.rows), r.passed) for r in runs] == [
        ("dynamo", 6, 4, 3, 1),
        ("onnx", 6, 4, 1, 1),
    ]
    meta = {"date": "today", "targets": {"fam": {"dynamo": 50, "onnx": 95}}}
    causes = {"causes": {"baked-length": "a guard on the traced length."}, "rows": {"dynamo:fam/b": "baked-length"}}
    block = tool.render(runs, meta, causes)
    assert "| fam | dynamo | 6 | 4 | 3 | 1 | 33 % | 50 % (not met) |" in block
    assert "| fam | onnx | 6 | 4 | 1 | 1 | 100 % | 95 % (met) |" in block
    assert "**baked-length** (1): a guard on the traced length. Models: dynamo: fam/b." in block
    # An untriaged failure is listed with the sweep's own error, never dropped.
    assert "dynamo: fam/c (export-error): boom" in block
    assert tool.rewrite("# T\n\nold\n", block).startswith("# T\n\n" + tool.START)
    # The architecture subset is counted out of its size, entries not swept included.
    (sweeps / "openvino_fam.json").write_text(json.dumps({"rows": rows}))
    subset = {"fam": ["a", "b", "d"]}
    lines = tool.subset_summary(tool.load_runs(sweeps, corpus), subset, target=60)
    expected = "1 of 3 pass (33 %; 2 swept; 1 not swept), target 60 % (not met)."
    assert "- openvino on the 3-architecture subset (`docs/sweeps/subset40.json`): " + expected in lines
    assert any(line.startswith("- executorch on the 3-architecture subset") and "0 swept" in line for line in lines)


def test_coverage_doc_is_current() -> None:
    tool = _tool()
    assert tool.main(["--check"]) == 0, "docs/coverage.md is stale: run `python tools/coverage_report.py`"


def test_a_rerun_listed_in_meta_replaces_the_entry_s_earlier_rows(tmp_path: Path) -> None:
    corpus, sweeps = tmp_path / "corpus", tmp_path / "sweeps"
    (corpus / "fam").mkdir(parents=True)
    sweeps.mkdir()
    for name in ("a", "b"):
        (corpus / "fam" / f"{name}.json").write_text("{}")
    (sweeps / "dynamo_fam.json").write_text(json.dumps({"rows": [_row("a", "ok"), _row("b", "grown-run-error")]}))
    # Sorts before the first file by name: only the meta's order makes it the later run.
    (sweeps / "dynamo_fam.0fix.json").write_text(json.dumps({"rows": [_row("b", "ok")]}))
    tool = _tool()
    # Not listed: both rows of b count.
    assert [(len(r.rows), r.passed) for r in tool.load_runs(sweeps, corpus)] == [(3, 2)]
    (sweeps / "meta.json").write_text(json.dumps({"reruns": ["dynamo_fam.0fix.json"]}))
    assert [(len(r.rows), r.passed) for r in tool.load_runs(sweeps, corpus)] == [(2, 2)]
