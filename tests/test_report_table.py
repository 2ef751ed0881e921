"""The printed export report: by default the rules that ran for the format, cut to the terminal; `--all` all."""

from __future__ import annotations

from hfexport.report import ExportReport
from hfexport.rewrites.engine import RuleOutcome


def _report() -> ExportReport:
    rules = [
        RuleOutcome("patch/a", "patch", "fix", 2, "fired"),
        RuleOutcome("fx/b", "fx", "fix", 0, "no-match"),
        RuleOutcome("patch/c", "patch", "fix", 0, "other-backend", "only for onnx"),
        RuleOutcome("patch/d", "patch", "fix", 0, "not-applicable", "the model has no instances of X " * 20),
        RuleOutcome("onnx/e", "onnx", "optimization", 0, "disabled", "disabled by the rule selection"),
    ]
    return ExportReport("onnx", "LlamaForCausalLM", rules=rules)


def test_the_default_table_lists_what_ran_and_counts_the_rest() -> None:
    lines = _report().table(width=80).splitlines()
    assert lines[1].split() == ["stage", "rule", "kind", "hits", "status"]
    assert [line.split()[1] for line in lines[2:4]] == ["patch/a", "fx/b"]
    assert "patch/c" not in "\n".join(lines) and "patch/d" not in "\n".join(lines)
    assert lines[4].startswith("(3 more rule(s) did not run for this export: 1 disabled, 1 not-applicable, 1 other")


def test_all_rules_are_listed_on_request_and_lines_fit_the_width() -> None:
    text = _report().table(all_rules=True, width=80)
    assert all(rule in text for rule in ("patch/c", "patch/d", "onnx/e")) and "more rule(s)" not in text
    assert max(len(line) for line in text.splitlines()) <= 80
    assert len(_report().to_dict()["rules"]) == 5  # the JSON keeps every rule


def test_progress_lines_give_elapsed_time_and_an_eta() -> None:
    from hfexport.core.timing import duration, eta

    assert [duration(s) for s in (4.6, 65, 3725)] == ["5s", "1m05s", "1h02m"]
    assert eta(2, 5, 60) == "elapsed 1m00s, ETA 1m30s"  # 30 s each, 3 left
    assert eta(0, 5, 10) == "elapsed 10s" and eta(5, 5, 100) == "elapsed 1m40s"


def test_the_report_records_what_the_onnx_export_used() -> None:
    import pytest

    pytest.importorskip("onnxscript")
    from hfexport import OnnxConfig, OnnxExporter
    from hfexport.lowerings.onnx import newest_opset
    from hfexport.tiny import TINY_MODELS

    tiny = TINY_MODELS["tiny-llama"]
    exporter = OnnxExporter()
    exporter.export(tiny.build(), tiny.sample_inputs(), config=OnnxConfig(dynamic=True))  # no opset given
    used = exporter.report.to_dict()["used"]
    assert used["opset"] == newest_opset() and used["dtype"] == "float32" and used["weights"] == "float32"
    assert "onnx/rms-norm-fusion" in used["fusions"] and used["contrib_ops"].startswith("com.microsoft")
    assert "used: dtype float32, opset" in str(exporter.report)


def test_validation_checks_other_shapes_and_reports_a_baked_one(tmp_path) -> None:
    from hfexport import DynamoConfig, DynamoExporter
    from hfexport.artifacts import save, validate
    from hfexport.tiny import TINY_MODELS

    tiny = TINY_MODELS["tiny-llama"]
    model, inputs = tiny.build(), tiny.sample_inputs()
    others = {"grown": tiny.sample_inputs(seed=1, length=11), "batch+1": tiny.sample_inputs(seed=1, batch=3)}
    for dynamic in (True, False):
        out = tmp_path / f"dynamic-{dynamic}"
        save(DynamoExporter().export(model, inputs, config=DynamoConfig(dynamic=dynamic)), out)
        validation = validate(out, model, inputs, trust=True, other_inputs=others)
        assert [c.name for c in validation.checks] == ["grown", "batch+1"]
        assert validation.outputs and all(o.ok for o in validation.outputs)  # the traced shape matches either way
        if dynamic:
            assert validation.ok and "ok   grown (input_ids [2, 11]" in str(validation)
        else:
            # The static program refuses the other shapes: each check fails with the runtime's reason.
            assert not validation.ok and all(c.problem and not c.outputs for c in validation.checks)
            assert "FAIL grown (input_ids [2, 11], attention_mask [2, 11]):" in str(validation)
            assert validation.to_dict()["shapes"][0]["ok"] is False
