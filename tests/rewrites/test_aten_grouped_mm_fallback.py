"""`aten/grouped-mm-fallback` on whole models: what the ONNX graph holds, and where the rule stays out."""

from __future__ import annotations

import pytest
import torch

from hfexport import HfExportError, OnnxConfig, OnnxExporter, RuleSelection
from hfexport.naming import onnx_feed
from hfexport.tiny import get_tiny_model

RULE = "aten/grouped-mm-fallback"


@pytest.mark.slow
def test_moe_onnx_export_translates_grouped_mm_and_matches_eager() -> None:
    # The fp32 experts' `transformers::grouped_mm_fallback` op has no torch.onnx translation; the override gives
    # it one. (On Dynamo it stays grouped_mm: tests/test_seed_loading.py.)
    import onnxruntime as ort

    tiny = get_tiny_model("tiny-qwen3-moe")
    model, inputs = tiny.build(), tiny.sample_inputs()
    exporter = OnnxExporter()
    program = exporter.export(model, inputs, OnnxConfig(dynamic=True))
    assert exporter.report.hits["aten"][RULE] == model.config.num_hidden_layers * 2  # gate_up and down
    domains = {node.domain for node in program.model_proto.graph.node}
    assert domains <= {"", "com.microsoft"}, domains
    with pytest.raises(HfExportError, match="grouped_mm"):
        OnnxExporter().export(model, inputs, OnnxConfig(dynamic=True, rules=RuleSelection(disable=(RULE,))))
    session = ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    # Batch 3 and a length past the sample's; then one token (most experts get no rows).
    for ids in (torch.randint(3, 128, (3, 11)), torch.randint(3, 128, (2, 1))):
        feed_inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        with torch.no_grad():
            expected = model(**feed_inputs).logits
        actual = session.run(None, onnx_feed(names, {k: v for k, v in feed_inputs.items() if k in names}))[0]
        torch.testing.assert_close(torch.from_numpy(actual), expected, atol=1e-4, rtol=1e-4)


def test_dense_export_installs_the_override_and_it_never_fires() -> None:
    tiny = get_tiny_model("tiny-llama")
    exporter = OnnxExporter()
    exporter.export(tiny.build(), tiny.sample_inputs(), OnnxConfig())
    outcome = {o.id: o for o in exporter.report.rules}[RULE]
    assert (outcome.status, outcome.hits) == ("no-match", 0)
    assert RULE not in exporter.report.hits.get("aten", {})
