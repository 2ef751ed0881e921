"""`hfexport sweep`: the models x rules hit matrix over corpus configs, its CSV/JSON/HTML, dead and expired rules."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hfexport.apps.sweep import Sweep, SweepRow
from hfexport.rewrites.engine import default_registry
from hfexport.testing.corpus import default_root

ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}


def _hfexport(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hfexport", *args], capture_output=True, text=True, env=ENV)


@pytest.mark.slow
def test_sweep_over_tiny_configs_writes_the_hit_matrix_and_heatmap(tmp_path: Path) -> None:
    configs = tmp_path / "configs"
    configs.mkdir()
    for name in ("llama", "falcon_mamba"):
        shutil.copy(default_root() / "causal_lm" / f"{name}.json", configs)
    (configs / "broken.json").write_text('{"not": "a corpus entry"}')  # one bad config costs one row
    (configs / "_skipped.json").write_text("{}")  # a corpus folder's notes, not an entry
    out = {k: tmp_path / f"sweep.{k}" for k in ("csv", "json", "html")}
    args = ["sweep", "--configs", str(configs), "--format", "dynamo", "--jobs", "2"]
    result = _hfexport(*args, *(x for k, p in out.items() for x in (f"--{k}", str(p))))
    assert result.returncode == 0, result.stderr[-3000:]

    data = json.loads(out["json"].read_text())
    rows = {r["model"]: r for r in data["rows"]}
    assert set(rows) == {"causal_lm/llama", "causal_lm/falcon_mamba", "broken"}
    assert rows["causal_lm/llama"]["status"] == "ok" and rows["causal_lm/llama"]["hits"] == {}
    assert rows["causal_lm/llama"]["max_abs_diff"] <= rows["causal_lm/llama"]["tolerance"]
    # Past the sample: the shapes that find baked lengths and batches (the corpus tests' checks).
    assert {"sample", "grown", "long", "longer", "batch+1"} <= set(rows["causal_lm/llama"]["shapes"])
    scan = rows["causal_lm/falcon_mamba"]
    assert scan["status"] == "ok" and scan["hits"]["patch/mamba-selective-scan-hop"] > 0
    assert rows["broken"]["status"] == "invalid-config" and "KeyError" in rows["broken"]["error"]
    dynamo_rules = [r.id for r in default_registry().rules() if r.applies_to("dynamo")]
    assert data["rules"] == dynamo_rules and data["fired"] == ["patch/mamba-selective-scan-hop"]
    assert set(data["dead_rules"]) == set(dynamo_rules) - {"patch/mamba-selective-scan-hop"}
    assert data["summary"].startswith("dynamo: 2/3 models ok")

    table = list(csv.reader(out["csv"].read_text().splitlines()))
    assert table[0] == ["model", "status", "max_abs_diff", "tolerance", "export_s", *dynamo_rules]
    scan_line = next(line for line in table if line[0] == "causal_lm/falcon_mamba")
    assert (
        int(scan_line[5 + dynamo_rules.index("patch/mamba-selective-scan-hop")])
        == scan["hits"]["patch/mamba-selective-scan-hop"]
    )

    page = out["html"].read_text()
    assert page.startswith("<!doctype html>") and "causal_lm/falcon_mamba" in page
    assert "<div>patch/mamba-selective-scan-hop</div>" in page and 'class="fail"' in page
    assert "Dead rules" in page and "patch/cpmant-mask-arange" in page
    assert "dead rules (0 hits on every model):" in result.stdout and "[3/3]" in result.stderr


@pytest.mark.slow
def test_generation_sweep_compares_tokens_with_the_model_s_own_generate(tmp_path: Path) -> None:
    out = {k: tmp_path / f"gen.{k}" for k in ("json", "markdown")}
    entry = default_root() / "causal_lm" / "llama.json"
    args = ["sweep", "--configs", str(entry), "--format", "dynamo", "--generation"]
    result = _hfexport(*args, "--json", str(out["json"]), "--markdown", str(out["markdown"]))
    assert result.returncode == 0, result.stderr[-3000:]
    data = json.loads(out["json"].read_text())
    (row,) = data["rows"]
    assert data["check"] == "generation" and data["summary"].startswith("dynamo generation: 1/1 models ok")
    assert row["status"] == "ok" and row["tokens_differ"] == 0.0 and row["components"] == ["prefill", "decode"]
    assert row["max_abs_diff"] is None and row["export_s"] > 0
    table = out["markdown"].read_text().splitlines()
    assert table[0] == "| model | status | export s | diff | rules fired | error |"
    assert table[2].startswith("| causal_lm/llama | ok |") and table[-1] == data["summary"]
    assert "to dynamo for generation" in result.stderr


def test_static_slots_without_generation_are_refused() -> None:
    result = _hfexport("sweep", "--configs", str(default_root() / "causal_lm" / "llama.json"), "--static", "64")
    assert result.returncode == 2 and "add --generation" in result.stderr and "sweeping" not in result.stderr


def test_sweep_refuses_png_without_matplotlib_before_running_anything(tmp_path: Path) -> None:
    if importlib.util.find_spec("matplotlib") is not None:
        pytest.skip("matplotlib is installed: the PNG is tested below")
    result = _hfexport("sweep", "--configs", str(default_root()), "--png", str(tmp_path / "h.png"))
    assert result.returncode != 0 and "--png needs matplotlib" in result.stderr
    assert "sweeping" not in result.stderr and not (tmp_path / "h.png").exists()


def _sweep() -> Sweep:
    rows = [
        SweepRow("a", "llama", "ok", 1e-7, 1e-4, {"fx/x": 2}),
        SweepRow("b", "mamba", "export-error", None, None, {"fx/x": 1, "patch/y": 3}, error="boom <&>"),
    ]
    return Sweep("dynamo", rows, ["patch/y", "fx/x", "fx/dead"], {"fx/x": "torch 2.13.0 satisfies torch>=2.12"})


def test_sweep_tables_mark_dead_and_expired_rules_and_escape_html() -> None:
    sweep = _sweep()
    assert sweep.fired == ["patch/y", "fx/x"] and sweep.dead == ["fx/dead"] and sweep.passed == 1
    page = sweep.to_html()
    assert "boom &lt;&amp;&gt;" in page and "<&>" not in page
    assert "<li>fx/dead</li>" in page and "fx/x: torch 2.13.0 satisfies" in page
    text = sweep.table()
    assert "dead rules (0 hits on every model): fx/dead" in text and "expired rules: fx/x (torch" in text
    assert json.loads(sweep.to_json())["expired_rules"] == {"fx/x": "torch 2.13.0 satisfies torch>=2.12"}


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="matplotlib is not installed")
def test_sweep_png_heatmap(tmp_path: Path) -> None:
    path = _sweep().save_png(tmp_path / "h.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rows_of_cases_without_a_report_are_named_like_finished_rows(tmp_path: Path) -> None:
    from hfexport.apps.sweep import crash_row, timeout_row

    entry = Path(__file__).parent / "fixtures" / "corpus_all" / "image_classification" / "hiera.json"
    row = timeout_row(entry, 300)
    # The same `family/model_type` id as a row the case reports itself, so tables and the triage match it.
    assert (row.model, row.model_type, row.status, row.error) == (
        "image_classification/hiera",
        "hiera",
        "timeout",
        "over 300s",
    )
    # A variant's row is named with its variant, as `CorpusEntry.name` names it.
    variant = tmp_path / "hiera@x.json"
    variant.write_text(json.dumps({**json.loads(entry.read_text()), "variant": "depths=1"}))
    assert timeout_row(variant, 300).model == "image_classification/hiera@depths=1"
    broken = tmp_path / "broken.json"
    broken.write_text('{"not": "a corpus entry"}')
    assert (crash_row(broken, "killed", 1.0).model, crash_row(broken, "killed", 1.0).model_type) == ("broken", "")
