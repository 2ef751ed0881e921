"""What the patch rules are for, beyond numerics: the graphs they leave behind."""

from __future__ import annotations

import torch

from hfexport import DynamoConfig, DynamoExporter, RuleSelection
from hfexport.tiny import get_tiny_model


def _custom_ops(program: torch.export.ExportedProgram) -> set[str]:
    return {
        str(node.target)
        for node in program.graph.nodes
        if node.op == "call_function" and str(node.target).startswith("transformers.")
    }


def test_moe_export_has_no_transformers_custom_op_and_the_rule_is_why() -> None:
    tiny = get_tiny_model("tiny-qwen3-moe")
    model, inputs = tiny.build(), tiny.sample_inputs()
    exporter = DynamoExporter()
    program = exporter.export(model, inputs, DynamoConfig(dynamic=True))
    assert _custom_ops(program) == set()
    assert exporter.report.hits["patch"]["patch/moe-grouped-mm-portable"] > 0
    without = DynamoExporter().export(
        model, inputs, DynamoConfig(dynamic=True, rules=RuleSelection(disable=("patch/moe-grouped-mm-portable",)))
    )
    assert _custom_ops(without), "without the rule the opaque fallback op is exported"
    ids = torch.randint(3, 128, (3, 11))
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    actual = program.module()(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)


def test_dense_export_reports_the_moe_rule_not_applicable() -> None:
    tiny = get_tiny_model("tiny-llama")
    exporter = DynamoExporter()
    exporter.export(tiny.build(), tiny.sample_inputs(), DynamoConfig())
    assert "patch/moe-grouped-mm-portable" in exporter.report.not_applicable
    assert exporter.report.hits == {}
