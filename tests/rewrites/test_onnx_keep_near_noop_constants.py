"""onnx/keep-near-noop-constants: without the rule the onnxscript optimizer drops the constants of its examples
(an RMSNorm's 1e-8 epsilon: NaN on the zero row; a scale within 1e-5 of 1); the rule's examples, run in
tests/rewrites/test_examples.py, show that with it ONNX Runtime matches eager after the optimizer."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("onnxscript")
pytest.importorskip("onnxruntime")

from hfexport.rewrites.rules.onnx.keep_near_noop_constants import keep_near_noop_constants as rule
from hfexport.testing import harness


def _optimized(example, with_rule: bool):
    """The example through OnnxExporter (the optimizer on, every other rule off), with or without the rule."""
    module, inputs = example.build()
    with torch.no_grad():
        expected = module.eval()(**inputs)
    exported = harness.export("onnx", module, inputs, harness.selection_for(rule, "onnx", with_rule))
    assert exported.error is None, exported.error
    assert (exported.hits(rule.id) > 0) == with_rule
    ops = [node.op_type for node in exported.result.model.graph]
    actual = harness.leaves(harness.run("onnx", exported.result, inputs))[0]
    return expected, actual, ops


def test_without_the_rule_the_optimizer_drops_the_epsilon() -> None:
    expected, actual, ops = _optimized(rule.meta.examples[0], with_rule=False)
    assert "Add" not in ops
    assert torch.isnan(actual[0]).all() and not torch.isnan(expected).any()
    relative = ((actual[1] - expected[1]).abs() / expected[1].abs()).max().item()
    assert relative > 1e-5  # eps / mean(x**2) with x ~ 0.01


def test_without_the_rule_the_optimizer_drops_a_scale_near_one() -> None:
    expected, actual, ops = _optimized(rule.meta.examples[1], with_rule=False)
    assert "Mul" not in ops and "Div" not in ops
    assert not torch.allclose(actual, expected, atol=0.0, rtol=1e-6)


def test_with_the_rule_the_constants_survive_the_optimizer() -> None:
    for example in rule.meta.examples[:2]:
        expected, actual, ops = _optimized(example, with_rule=True)
        assert {"Add", "Mul", "Div"} & set(ops)
        torch.testing.assert_close(actual, expected, atol=0.0, rtol=1e-6)
