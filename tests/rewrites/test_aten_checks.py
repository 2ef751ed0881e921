"""aten/is-all-true: without the rule its first example does not export to ONNX (the rule's examples, run in
tests/rewrites/test_examples.py, show that with it ONNX Runtime matches eager), and its examples catch a
translation that ignores its input."""

from __future__ import annotations

from typing import Any

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


def _constant(value: bool) -> Any:
    def translation() -> Any:
        from onnxscript import opset18 as op

        def aten_is_all_true(self: Any) -> Any:
            return op.Cast(op.Constant(value_int=int(value)), to=9)  # BOOL, whatever `self` holds

        return aten_is_all_true

    return translation


@pytest.mark.parametrize("value", [True, False])
def test_a_translation_that_ignores_its_input_fails_an_example(value: bool) -> None:
    from hfexport.rewrites.examples import ExampleFailure, Match
    from hfexport.rewrites.kinds.onnx import AtenOverride
    from hfexport.rewrites.rules.aten.is_all_true import is_all_true as rule
    from hfexport.testing.harness import check_example

    broken = AtenOverride(rule.meta, target=rule.target, translation=_constant(value))
    failures = []
    for example in rule.meta.examples:
        if isinstance(example, Match):
            try:
                check_example(broken, example)
            except ExampleFailure as failure:
                failures.append(str(failure))
    assert failures and all("differs from eager" in f for f in failures), failures
