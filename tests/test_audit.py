"""`hfexport audit`: the rule table equals the engine's report, expiry is read from the installed packages,
and ablation tells a needed rule from one the export does without."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hfexport.audit import expiry_status, rule_diff, with_rule_disabled
from hfexport.cli import main
from hfexport.rewrites.rule import RuleMeta, RuleSelection


def test_audit_counts_equal_the_engine_report_and_ablation_finds_the_needed_rule(tmp_path: Path, capsys) -> None:
    from hfexport import OpenVINOConfig, OpenVINOExporter
    from hfexport.rewrites.engine import default_registry
    from hfexport.tiny import TINY_MODELS

    out = tmp_path / "audit.json"
    args = ["audit", "--model", "tiny-llama", "--format", "openvino", "--json", str(out), "--explain", "--ablate"]
    assert main(args) == 0
    printed = capsys.readouterr()
    audit = json.loads(out.read_text())
    rows = {r["id"]: r for r in audit["rules"]}
    assert set(rows) == set(default_registry().ids())

    # The same export made directly: the audit's counts and statuses are the engine's.
    tiny = TINY_MODELS["tiny-llama"]
    exporter = OpenVINOExporter()
    exporter.export(tiny.build(), tiny.sample_inputs(), config=OpenVINOConfig(dynamic=True))
    engine = {o.id: o for o in exporter.report.rules}
    assert audit["hits"] == {i: o.hits for i, o in engine.items() if o.hits} == audit["report"]["hits"]["openvino"]
    for rule_id, outcome in engine.items():
        assert (rows[rule_id]["hits"], rows[rule_id]["status"]) == (outcome.hits, outcome.status)
    assert rows["onnx/rms-norm-fusion"]["status"] == "other-backend"
    assert audit["exported"] and audit["validation"]["ok"]

    # Ablation: without cat-drop-legacy-empty OpenVINO cannot convert the cache concat; the fully-masked-rows
    # fix changes nothing on an all-ones attention mask.
    ablated = {i: r["ablation"] for i, r in rows.items() if r["ablation"]}
    assert set(ablated) == set(audit["hits"]) == {"openvino/cat-drop-legacy-empty", "openvino/sdpa-fully-masked-rows"}
    needed = ablated["openvino/cat-drop-legacy-empty"]
    assert needed["needed"] and not needed["exported"] and "convert" in needed["error"]
    spared = ablated["openvino/sdpa-fully-masked-rows"]
    assert not spared["needed"] and spared["exported"] and spared["matches"]
    assert max(spared["max_abs_diff"].values()) < 1e-4

    assert "why rules did or did not fire:" in printed.out and "• ablation 2/2" in printed.err
    assert "openvino/cat-drop-legacy-empty: needed: without it the export fails" in printed.out
    assert "openvino/drop-constant-inputs: ran in stage 'openvino' and matched nothing" in printed.out


@pytest.mark.slow
def test_onnx_moe_needs_the_portable_grouped_mm_but_not_the_fusions(capsys, tmp_path: Path) -> None:
    out = tmp_path / "audit.json"
    args = ["audit", "--model", "tiny-qwen3-moe", "--format", "onnx", "--json", str(out)]
    assert main([*args, "--ablate", "patch/moe-grouped-mm-portable,onnx/rms-norm-fusion"]) == 0
    rows = {r["id"]: r for r in json.loads(out.read_text())["rules"]}
    portable = rows["patch/moe-grouped-mm-portable"]["ablation"]
    assert portable["needed"] and not portable["exported"] and "translate" in portable["error"]
    fusion = rows["onnx/rms-norm-fusion"]["ablation"]
    assert not fusion["needed"] and fusion["matches"]


def test_expiry_is_met_only_by_an_installed_version_that_satisfies_it() -> None:
    import torch

    installed = torch.__version__.split("+")[0]
    expired, detail = expiry_status(RuleMeta(id="fx/old", why="w", upstream="hfexport==0 tests", expires="torch>=2.0"))
    assert expired and detail == f"torch {torch.__version__} satisfies torch>=2.0"
    assert expiry_status(RuleMeta(id="fx/new", why="w", upstream="hfexport==0 tests", expires="torch>=99")) == (
        False,
        f"torch {torch.__version__} does not satisfy yet torch>=99",
    )
    assert expiry_status(
        RuleMeta(id="fx/pkg", why="w", upstream="hfexport==0 tests", expires="no-such-package>=1")
    ) == (
        False,
        "no-such-package is not installed",
    )
    assert expiry_status(RuleMeta(id="fx/none", why="w", upstream="hfexport==0 tests")) == (False, "")
    assert expiry_status(RuleMeta(id="fx/eq", why="w", upstream="hfexport==0 tests", expires=f"torch=={installed}"))[0]


def test_ablation_config_adds_one_disabled_rule_to_the_callers_selection() -> None:
    from hfexport import OnnxConfig

    config = OnnxConfig(dynamic=True, rules=RuleSelection(enable=("onnx/",), disable=("onnx/gelu-tanh-fusion",)))
    ablated = with_rule_disabled(config, "onnx/rms-norm-fusion")
    assert ablated.rules == RuleSelection(enable=("onnx/",), disable=("onnx/gelu-tanh-fusion", "onnx/rms-norm-fusion"))
    assert ablated.dynamic and ablated.fusions == "cpu" and config.rules.disable == ("onnx/gelu-tanh-fusion",)


def test_method_patch_diff_compares_the_class_method_with_the_replacement() -> None:
    from hfexport.rewrites.engine import default_registry

    diff = rule_diff(default_registry().get("patch/cpmant-mask-arange"))
    assert diff is not None
    assert diff.startswith("--- transformers.models.cpmant.modeling_cpmant.CpmAntModel._prepare_attention_mask")
    removed = [line for line in diff.splitlines() if line.startswith("-")]
    added = [line for line in diff.splitlines() if line.startswith("+")]
    assert any("torch.tensor(list(range(seqlen - self.prompt_length))[::-1]" in line for line in removed)
    assert "+    countdown = torch.arange(seqlen - self.prompt_length - 1, -1, -1, device=device)" in added
