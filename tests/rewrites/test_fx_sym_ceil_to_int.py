"""fx/sym-ceil-to-int: what it is needed for. torch.export.save refuses each Match example's program without it
(a math.ceil node on a symbolic size); with it the program saves, loads, and the loaded program equals eager
exactly at every size tried, the ceiling's edge cases (a multiple, one above, one token) included."""

from __future__ import annotations

import importlib
import io
import math

import pytest
import torch

from hfexport.rewrites.engine import apply_rule
from hfexport.rewrites.examples import Match, assert_same_outputs
from hfexport.testing.harness import export_program

# The rule package re-exports the rule under its module's name, so the module is imported by path.
module = importlib.import_module("hfexport.rewrites.rules.fx.sym_ceil_to_int")
rule = module.sym_ceil_to_int
symbolic = importlib.import_module("hfexport.rewrites.rules._symbolic")


def _round_trip(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    return torch.export.load(buffer)


def _ceil_nodes(program: torch.export.ExportedProgram) -> int:
    return sum(n.op == "call_function" and n.target is math.ceil for n in program.graph.nodes)


@pytest.mark.parametrize("index", [i for i, e in enumerate(rule.meta.examples) if isinstance(e, Match)])
def test_the_match_cannot_be_saved_without_the_rule_and_matches_eager_after_a_round_trip(index: int) -> None:
    example = rule.meta.examples[index]
    model, inputs = example.build()
    model.eval()
    program = export_program(model, inputs, dynamic=True)
    assert _ceil_nodes(program) == 1
    with pytest.raises(Exception, match="ceil"):
        torch.export.save(program, io.BytesIO())
    assert apply_rule(rule, program).hits == 1
    assert _ceil_nodes(program) == 0
    loaded = _round_trip(program).module()
    with torch.no_grad():
        for feed in (inputs, example.other_inputs()):
            assert_same_outputs(model(**feed), loaded(**feed), 0.0, 0.0, rule.id)


@pytest.mark.parametrize("fraction", [0.75, 1.0, 0.5, 1.25, 2.0])
def test_the_capacity_equals_eager_for_every_token_count(fraction: float) -> None:
    """ceil(fraction * tokens) in integers against Python's float ceiling, 1 to 40 tokens (the saved program)."""
    model = symbolic._CapacityOfTokens(fraction).eval()
    program = export_program(model, {"x": torch.randn(7, 3)}, dynamic=True)
    assert apply_rule(rule, program).hits == 1
    loaded = _round_trip(program).module()
    with torch.no_grad():
        for tokens in range(1, 41):
            x = torch.randn(tokens, 3)
            assert torch.equal(loaded(x=x), model(x=x)), tokens


def test_a_fraction_with_a_long_numerator_is_declined() -> None:
    """0.1 is 3602879701896397 / 2**55: the integer ceiling could differ from the float one, so the node stays."""
    program = export_program(symbolic._CapacityOfTokens(0.1).eval(), {"x": torch.randn(7, 3)}, dynamic=True)
    assert apply_rule(rule, program).hits == 0
    assert _ceil_nodes(program) == 1


def test_the_rule_stays_off_onnx_whose_floordiv_truncates() -> None:
    """Why the rule is Dynamo-only: torch.onnx translates math.ceil itself, and translates `operator.floordiv` on
    sizes as ONNX Div (onnxscript's operator_floordiv truncates), so the integer form would give ceil(5.25) = 5."""
    import onnxruntime as ort

    assert rule.meta.backends == ("dynamo",)
    model = symbolic._CapacityOfTokens(0.75).eval()
    program = export_program(model, {"x": torch.randn(7, 3)}, dynamic=True)
    assert apply_rule(rule, program).hits == 1
    proto = torch.onnx.export(program, (), dynamo=True, optimize=False, verbose=False).model_proto
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    x = torch.randn(7, 3)
    (got,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    assert int(model(x=x).sum()) == 6 and int(got.sum()) == 5
