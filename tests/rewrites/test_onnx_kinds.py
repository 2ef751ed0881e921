"""The ONNX rule kinds: IR rules are counted and stamped; ATen overrides are skipped when they cannot apply."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnxscript")

from hfexport.rewrites.engine import RewriteContext
from hfexport.rewrites.examples import ExampleFailure, Match, NoMatch
from hfexport.rewrites.kinds.onnx import RULE_ID_KEY, AtenOverride, OnnxRewriteRule, TranslationTable, apply_onnx_rule
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
    assert apply_onnx_rule(rule, model) == 1
    assert [(n.op_type, n.metadata_props.get(RULE_ID_KEY)) for n in model.graph] == [
        ("Identity", "onnx/test-double-neg")
    ]


def test_aten_override_of_a_missing_op_is_not_applicable() -> None:
    from hfexport.rewrites.kinds.onnx import apply_aten

    meta = RuleMeta(id="aten/test-missing", why="test", upstream="hfexport==0 tests", backends=("onnx",))
    rule = AtenOverride(meta, target="aten.no_such_op.default", translation=lambda: print)
    context = RewriteContext(backend="onnx")
    table = TranslationTable(context, opset=18)
    assert apply_aten(rule, table) == 0
    assert not table.functions
    assert context.outcomes[rule.id].status == "not-applicable"
