"""aten/is-all-true: without the rule its first example does not export to ONNX (the rule's examples, run in
tests/rewrites/test_examples.py, show that with it ONNX Runtime matches eager)."""

from __future__ import annotations

import pytest
import torch


def test_the_checked_example_does_not_translate_without_its_rule() -> None:
    from hfexport.rewrites.rules.aten.is_all_true import is_all_true as rule

    module, inputs = rule.meta.examples[0].build()
    program = torch.export.export(module.eval(), (), inputs)
    assert any("_is_all_true" in str(node.target) for node in program.graph.nodes)
    with pytest.raises(Exception, match=r"_is_all_true"):
        torch.onnx.export(program, (), kwargs=inputs, dynamo=True, verbose=False)


def test_the_noop_squeeze_example_does_not_load_without_its_rule() -> None:
    import onnxruntime as ort

    from hfexport.rewrites.rules.aten.squeeze_dim_noop import squeeze_dim_noop as rule

    module, inputs = rule.meta.examples[0].build()
    program = torch.onnx.export(torch.export.export(module.eval(), (), inputs), (), dynamo=True, verbose=False)
    with pytest.raises(Exception, match=r"must be 1"):
        ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
