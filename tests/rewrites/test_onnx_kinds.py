"""The ONNX rule kinds: IR rules are counted and stamped; ATen overrides are skipped when they cannot apply."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("onnxscript")

from hfexport.rewrites.engine import RewriteContext, RuleRegistry, apply, apply_rule, default_registry
from hfexport.rewrites.examples import ExampleFailure, Match, NoMatch
from hfexport.rewrites.kinds.onnx import RULE_ID_KEY, AtenOverride, OnnxRewriteRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.testing.harness import check_example

_DOUBLE_NEG = """
<ir_version: 8, opset_import: ["" : 18]>
g (float[3] x) => (float[3] y) {
    a = Neg(x)
    y = Neg(a)
}
"""
_SINGLE_NEG = """
<ir_version: 8, opset_import: ["" : 18]>
g (float[3] x) => (float[3] y) {
    y = Neg(x)
}
"""


def _double_neg_rule() -> Any:
    from onnxscript.rewriter import RewriteRuleClassBase

    class DoubleNeg(RewriteRuleClassBase):
        def pattern(self, op: Any, x: Any) -> Any:
            return op.Neg(op.Neg(x))

        def rewrite(self, op: Any, x: Any) -> Any:
            return op.Identity(x)

    return DoubleNeg.rule()


_FEED = {"x": np.array([1.0, -2.0, 3.5], dtype=np.float32)}


def _ir_rule(examples: tuple) -> OnnxRewriteRule:
    meta = RuleMeta(
        id="onnx/test-double-neg", why="test", upstream="hfexport==0 tests", backends=("onnx",), examples=examples
    )
    return OnnxRewriteRule(meta, rewrite_rule=_double_neg_rule)


def test_ir_rule_examples_are_checked_and_hits_counted() -> None:
    match, nomatch = Match(lambda: (_DOUBLE_NEG, _FEED)), NoMatch(lambda: (_SINGLE_NEG, _FEED))
    rule = _ir_rule((match, nomatch))
    assert check_example(rule, match) == 1
    assert check_example(rule, nomatch) == 0
    with pytest.raises(ExampleFailure, match="did not fire"):
        check_example(rule, Match(lambda: (_SINGLE_NEG, _FEED)))


def test_ir_rule_stamps_the_nodes_it_produced() -> None:
    import onnx
    import onnx_ir as ir

    model = ir.serde.deserialize_model(onnx.parser.parse_model(_DOUBLE_NEG))
    rule = _ir_rule((Match(lambda: (_DOUBLE_NEG, _FEED)), NoMatch(lambda: (_SINGLE_NEG, _FEED))))
    assert apply_rule(rule, model).hits == 1
    assert [(n.op_type, n.metadata_props.get(RULE_ID_KEY)) for n in model.graph] == [
        ("Identity", "onnx/test-double-neg")
    ]


def test_aten_override_of_a_missing_op_is_not_applicable() -> None:
    examples = (Match(lambda: (_DOUBLE_NEG, _FEED)), NoMatch(lambda: (_SINGLE_NEG, _FEED)))
    meta = RuleMeta(
        id="aten/test-missing", why="test", upstream="hfexport==0 tests", backends=("onnx",), examples=examples
    )
    rule = AtenOverride(meta, target="aten.no_such_op.default", translation=lambda: print)
    registry = RuleRegistry()
    registry.register(rule)
    context = RewriteContext(backend="onnx")
    result = apply("aten", 18, context, registry)
    assert result.hits == {rule.id: 0} and not dict(result.outputs)
    assert context.outcomes[rule.id].status == "not-applicable"
    assert "no_such_op" in context.outcomes[rule.id].reason


def test_aten_overrides_make_the_translation_table_in_one_call_and_count_dispatches_later() -> None:
    context = RewriteContext(backend="onnx")
    result = apply("aten", 18, context, default_registry())
    table = dict(result.outputs)
    squeeze = default_registry().get("aten/squeeze-dim-noop").resolve_target()
    assert squeeze in table and set(result.hits) >= {"aten/squeeze-dim-noop", "aten/is-all-true"}
    assert context.outcomes["aten/is-all-true"].status == "no-match"
    # A dispatch during the translation, after the stage, is a hit of its rule at once (the counting wrapper
    # calls this).
    context.hit("aten/is-all-true")
    assert context.outcomes["aten/is-all-true"].status == "fired" and context.outcomes["aten/is-all-true"].hits == 1


def test_aten_override_translates_its_other_overloads_with_the_same_counted_function() -> None:
    rule = default_registry().get("aten/unsigned-right-shift")
    table = dict(apply("aten", 18, RewriteContext(backend="onnx"), default_registry()).outputs)
    tensor = torch.ops.aten.bitwise_right_shift.Tensor
    scalar = torch.ops.aten.__rshift__.Scalar
    assert rule.resolve_target() is tensor and rule.resolve_target(rule.also[0]) is scalar
    assert table[tensor] is table[scalar]
