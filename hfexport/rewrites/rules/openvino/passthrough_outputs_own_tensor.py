"""Outputs that return a model input unchanged, as OpenVINO names them."""

from __future__ import annotations

from typing import Any

import torch

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.openvino import OpenVINOModelRule
from hfexport.rewrites.rule import RuleMeta


def separate_passthrough_outputs(model: Any) -> int:
    """Give each output that is an input passed through (a Result fed by a Parameter) its own tensor, in place;
    return how many. The output is read through an `Add` of zero (`LogicalOr` with False for bool), a new Result
    in the same place, so naming it leaves the input's name alone."""
    import numpy as np
    import openvino as ov
    from openvino import opset13 as ops

    results = list(model.get_results())
    fed = [r.input_value(0).get_node().get_type_name() == "Parameter" for r in results]
    if not any(fed):
        return 0
    rebuilt = []
    for result, passthrough in zip(results, fed, strict=True):
        source = result.input_value(0)
        if passthrough:
            zero = ops.constant(np.zeros((), dtype=source.get_element_type().to_dtype()))
            boolean = source.get_element_type() == ov.Type.boolean
            copy = ops.logical_or(source, zero) if boolean else ops.add(source, zero)
            result = ops.result(copy)
        rebuilt.append(result)
    for result in results:
        model.remove_result(result)
    model.add_results(rebuilt)
    return sum(fed)


class _ReturnsItsInput(torch.nn.Module):
    """A step that returns one of its inputs as it got it, as a sliding cache layer returns its window."""

    def forward(self, x: torch.Tensor, window: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.relu() * window, window, keep


class _ReturnsNewValues(torch.nn.Module):
    def forward(self, x: torch.Tensor, window: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return x.relu(), window + 1


passthrough_outputs_own_tensor = OpenVINOModelRule(
    RuleMeta(
        id="openvino/passthrough-outputs-own-tensor",
        why="a Result fed by a Parameter shares the Parameter's tensor in OpenVINO 2026.4: naming the output named "
        "the input too, and after saving the input kept only the output's name (a gemma2 prefill took "
        "`output.past_key_values.layers_0__sliding_window_tensor`, the window a sliding layer returns as it got it, "
        "which the generation loop does not feed); set_names on the input afterwards does not undo it. Each such "
        "output is read through an Add of zero (LogicalOr with False for bool), exact, a Result of its own",
        upstream="openvino==2026.4.1 (Result and Parameter share one descriptor tensor; names set on the output "
        "are serialized on the input)",
        backends=("openvino",),
        needed="the need is the saved names: "
        "tests/test_openvino_exporter.py::test_an_input_passed_through_keeps_its_own_name_after_saving reads them "
        "back from a saved model (the harness compares outputs by position, in memory)",
        models=("gemma2", "cohere2", "gemma3_text", "exaone4", "gpt_oss"),
        examples=(
            Match(
                lambda: (
                    _ReturnsItsInput(),
                    {"x": torch.randn(2, 3), "window": torch.tensor(7.0), "keep": torch.tensor([True, False])},
                ),
                "a float and a bool input returned as they came, beside a computed output",
            ),
            NoMatch(
                lambda: (_ReturnsNewValues(), {"x": torch.randn(2, 3), "window": torch.tensor(7.0)}),
                "every output computed from the inputs",
            ),
        ),
    ),
    transform=separate_passthrough_outputs,
)
