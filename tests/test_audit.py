"""`hfexport audit`: the rule table equals the engine's report, expiry is read from the installed packages,
and ablation tells a needed rule from one the export does without."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hfexport.apps.audit import with_rule_disabled
from hfexport.cli import main
from hfexport.rewrites.catalogue import expiry_status, rule_diff
from hfexport.rewrites.rule import RuleMeta, RuleSelection


@pytest.mark.slow
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
    # fix changes nothing on an all-ones attention mask. (openvino/grouped-sdpa-without-repeat-kv leaves the
    # attention over this cache, grown by concatenation, as it is.)
    ablated = {i: r["ablation"] for i, r in rows.items() if r["ablation"]}
    assert set(ablated) == set(audit["hits"]) == {"openvino/cat-drop-legacy-empty", "openvino/sdpa-fully-masked-rows"}
    needed = ablated["openvino/cat-drop-legacy-empty"]
    assert needed["needed"] and not needed["exported"] and "convert" in needed["error"]
    spared = ablated["openvino/sdpa-fully-masked-rows"]
    assert not spared["needed"] and spared["exported"] and spared["matches"]
    assert max(spared["max_abs_diff"].values()) < 1e-4

    assert "why rules did or did not fire:" in printed.out and "• ablation 2/2" in printed.err
    # This export's rules (those that ran), the rest counted behind --all; every line fits 120 columns.
    assert max(map(len, printed.out.splitlines())) <= 120
    listed = {line.split()[1] for line in printed.out.splitlines() if line.startswith(("openvino ", "patch ", "fx "))}
    ran = {i for i, r in rows.items() if r["status"] in ("fired", "no-match")}
    assert listed == ran and "onnx/rms-norm-fusion" not in printed.out.split("why rules did")[0]
    assert f"({len(rows) - len(ran)} more rule(s) did not run for this export: " in " ".join(printed.out.split())
    assert "openvino/cat-drop-legacy-empty: needed: without it the export fails" in printed.out
    assert "openvino/drop-constant-inputs: ran in stage 'openvino' and matched nothing" in printed.out


def _rule(rule_id: str) -> object:
    from hfexport.rewrites.engine import default_registry

    return default_registry().get(rule_id)


def _example(rule_id: str, index: int) -> tuple:
    from hfexport.rewrites.engine import default_registry

    example = default_registry().get(rule_id).meta.examples[index]
    module, inputs = example.build()
    return module.eval(), inputs, example.opset


def test_explain_keeps_the_reason_an_onnx_rule_check_gave_for_each_match_it_declined() -> None:
    from hfexport import OnnxConfig
    from hfexport.apps.audit import run_audit

    # Attention at opset 24 is run by ONNX Runtime's own kernel: the fusion's check refuses it and says so.
    example = next(e for e in _rule("onnx/attention-as-matmul").meta.examples if type(e).__name__ == "NoMatch")
    module, inputs, opset = example.build()[0].eval(), example.build()[1], example.opset
    audit = run_audit(module, inputs, OnnxConfig(opset_version=opset), model_name="gqa-sdpa")
    row = audit.rule("onnx/attention-as-matmul")
    assert (row.status, row.hits) == ("no-match", 0)
    assert row.declined == {"below opset 25 ONNX Runtime runs Attention with its own kernel": 1}
    text = audit.render(explain=True)
    assert (
        "onnx/attention-as-matmul: ran in stage 'onnx' and fired nowhere: declined 1 matched site(s): "
        "below opset 25 ONNX Runtime runs Attention with its own kernel"
    ) in " ".join(text.split())  # wrapped to 120 columns
    assert max(map(len, text.splitlines())) <= 120
    assert audit.to_dict()["report"]["rules"]  # the engine's outcomes carry the reasons into the report
    reported = {o["id"]: o for o in audit.report["rules"]}
    assert reported["onnx/attention-as-matmul"]["declined"] == row.declined


def test_ablating_an_optimization_counts_the_runtime_nodes_it_saves_and_names_its_dependents() -> None:
    from hfexport import OnnxConfig
    from hfexport.apps.audit import run_audit

    # A pre-norm layer: RMSNorm fusion, then the residual Add folded into SkipSimplifiedLayerNormalization,
    # which requires the RMSNorm fusion and so goes with it.
    module, inputs, _ = _example("onnx/skip-rms-norm-fusion", 0)
    audit = run_audit(module, inputs, OnnxConfig(), ablate=("onnx/rms-norm-fusion", "onnx/skip-rms-norm-fusion"))
    assert audit.exported and audit.validation and audit.validation["ok"]
    norm = audit.rule("onnx/rms-norm-fusion").ablation
    skip = audit.rule("onnx/skip-rms-norm-fusion").ablation
    assert norm is not None and skip is not None
    assert norm.exported and norm.matches and skip.exported and skip.matches  # numerics equal either way
    # Both norm rules that build on the RMSNorm fusion go with it.
    assert sorted(norm.dependents) == ["onnx/rms-norm-core-fusion", "onnx/skip-rms-norm-fusion"]
    assert skip.dependents == []
    # Each is judged by ONNX Runtime's optimized graph: fewer nodes with the rule than without.
    assert norm.base_graph is not None and norm.graph is not None
    assert norm.nodes_saved == norm.graph.nodes - norm.base_graph.nodes > skip.nodes_saved > 0
    assert norm.op_changes["com.microsoft.SkipSimplifiedLayerNormalization"] < 0
    assert skip.op_changes["SimplifiedLayerNormalization"] > 0
    assert norm.needed and skip.needed
    assert norm.verdict.startswith(f"needed for speed: {norm.nodes_saved} node(s) fewer with it")
    assert (
        "disabling it also disabled onnx/rms-norm-core-fusion, onnx/skip-rms-norm-fusion (they require it)"
        in norm.verdict
    )


@pytest.mark.slow
def test_onnx_moe_needs_the_grouped_mm_translation_and_the_fusion_for_speed(capsys, tmp_path: Path) -> None:
    out = tmp_path / "audit.json"
    args = ["audit", "--model", "tiny-qwen3-moe", "--format", "onnx", "--json", str(out)]
    assert main([*args, "--ablate", "aten/grouped-mm-fallback,onnx/rms-norm-fusion"]) == 0
    rows = {r["id"]: r for r in json.loads(out.read_text())["rules"]}
    grouped = rows["aten/grouped-mm-fallback"]["ablation"]
    assert grouped["needed"] and not grouped["exported"] and "translate" in grouped["error"]
    # An optimization keeps numerics: it is needed for the nodes it saves in ONNX Runtime's graph.
    fusion = rows["onnx/rms-norm-fusion"]["ablation"]
    assert fusion["matches"] and fusion["nodes_saved"] > 0 and fusion["needed"]
    assert fusion["verdict"].startswith("needed for speed: ")
    assert "onnx/skip-rms-norm-fusion" in fusion["dependents"]


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
