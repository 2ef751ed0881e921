"""fx/gen-view-after-transpose: what it is needed for. torch.onnx fails on its Match example without it (the mask
from a parameter makes the re-trace take sdpa's math form), exports it with it (ONNX Runtime matches eager on two
shapes), and exports the NoMatch with a float mask from the inputs without it."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

from hfexport.rewrites.engine import apply_rule
from hfexport.rewrites.examples import Match, NoMatch, assert_same_outputs
from hfexport.testing.harness import export_program

# The rule package re-exports the rule under its module's name, so the module is imported by path.
module = importlib.import_module("hfexport.rewrites.rules.fx.gen_view_after_transpose")
rule = module.gen_view_after_transpose


def _to_onnx(program: torch.export.ExportedProgram) -> Any:
    return torch.onnx.export(program, (), dynamo=True, optimize=False, verbose=False)


def _ort(onnx_program: Any, inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    import onnxruntime as ort

    session = ort.InferenceSession(onnx_program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    feeds = dict(zip(names, (t.contiguous().numpy() for t in inputs.values()), strict=True))
    return [torch.from_numpy(a) for a in session.run(None, feeds)]


@pytest.mark.slow
def test_the_match_fails_in_torch_onnx_without_the_rule_and_exports_with_it() -> None:
    example = next(e for e in rule.meta.examples if isinstance(e, Match))
    model, inputs = example.build()
    model.eval()
    # Grad mode on, as in the ONNX lowering: torch.onnx's re-trace sees the parameter's requires_grad.
    program = export_program(model, inputs, dynamic=True)
    with pytest.raises(Exception, match="Cannot view a tensor"):
        _to_onnx(program)
    program = export_program(model, inputs, dynamic=True)
    assert apply_rule(rule, program).hits == 1
    onnx_program = _to_onnx(program)
    with torch.no_grad():
        for feed in (inputs, example.other_inputs()):
            assert_same_outputs(model(**feed), _ort(onnx_program, feed), 1e-5, 1e-5, rule.id)


def test_a_float_mask_from_the_inputs_needs_no_copy() -> None:
    model, inputs = module._InputMaskMerge(), module._qkv_mask()
    assert any(isinstance(e, NoMatch) for e in rule.meta.examples)
    program = export_program(model, inputs, dynamic=True)
    assert apply_rule(rule, program).hits == 0
    onnx_program = _to_onnx(program)
    with torch.no_grad():
        assert_same_outputs(model(**inputs), _ort(onnx_program, inputs), 1e-5, 1e-5, rule.id)
