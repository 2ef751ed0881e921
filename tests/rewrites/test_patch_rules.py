"""What the patch rules are for, beyond numerics: the graphs they leave behind."""

from __future__ import annotations

import pytest
import torch

from hfexport import OnnxConfig, OnnxExporter, RuleSelection
from hfexport.tiny import get_tiny_model


def _custom_ops(program: torch.export.ExportedProgram) -> set[str]:
    return {
        str(node.target)
        for node in program.graph.nodes
        if node.op == "call_function" and str(node.target).startswith("transformers.")
    }


def test_moe_onnx_export_needs_the_portable_experts_and_matches_eager() -> None:
    # On ONNX the fp32 experts' `transformers::grouped_mm_fallback` op has no translation; the rule swaps it for
    # plain ATen ops. (On Dynamo it stays grouped_mm: tests/test_seed_loading.py.)
    import onnxruntime as ort

    from hfexport import HfExportError, OnnxConfig, OnnxExporter
    from hfexport.naming import onnx_feed

    tiny = get_tiny_model("tiny-qwen3-moe")
    model, inputs = tiny.build(), tiny.sample_inputs()
    exporter = OnnxExporter()
    program = exporter.export(model, inputs, OnnxConfig(dynamic=True))
    assert exporter.report.hits["patch"]["patch/moe-grouped-mm-portable"] > 0
    with pytest.raises(HfExportError, match="grouped_mm"):
        OnnxExporter().export(
            model, inputs, OnnxConfig(dynamic=True, rules=RuleSelection(disable=("patch/moe-grouped-mm-portable",)))
        )
    ids = torch.randint(3, 128, (3, 11))
    feed_inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        expected = model(**feed_inputs).logits
    session = ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    actual = session.run(None, onnx_feed(names, {k: v for k, v in feed_inputs.items() if k in names}))[0]
    torch.testing.assert_close(torch.from_numpy(actual), expected, atol=1e-4, rtol=1e-4)


def test_dense_export_reports_the_moe_rule_not_applicable() -> None:
    tiny = get_tiny_model("tiny-llama")
    exporter = OnnxExporter()
    exporter.export(tiny.build(), tiny.sample_inputs(), OnnxConfig())
    assert "patch/moe-grouped-mm-portable" in exporter.report.not_applicable
    assert "patch" not in exporter.report.hits
