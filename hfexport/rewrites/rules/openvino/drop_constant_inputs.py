"""Model inputs as `openvino.convert_model` creates them from an `ExportedProgram`'s placeholders."""

from __future__ import annotations

from typing import Any

import torch

from hfexport.rewrites.example_models import dense_decoder
from hfexport.rewrites.examples import Built, Match, NoMatch
from hfexport.rewrites.kinds.openvino import OpenVINOModelRule
from hfexport.rewrites.rule import RuleMeta


def _is_constant_placeholder(parameter: Any) -> bool:
    # A non-tensor forward argument (use_cache=False, a None mask) is folded into the graph by torch.export;
    # the converter still makes a Parameter for its placeholder: no rank, no element type, no consumer.
    return (
        parameter.get_partial_shape().rank.is_dynamic
        and parameter.get_element_type().is_dynamic()
        and not parameter.output(0).get_target_inputs()
    )


def drop_constant_parameters(model: Any) -> int:
    dropped = [p for p in model.get_parameters() if _is_constant_placeholder(p)]
    for parameter in dropped:
        model.remove_parameter(parameter)
    if dropped:
        model.validate_nodes_and_infer_types()
    return len(dropped)


class _IgnoresAnInput(torch.nn.Module):
    """A tensor input the graph does not read: still an input of the model, with its type and rank."""

    def forward(self, x: torch.Tensor, unused: torch.Tensor) -> torch.Tensor:
        return x * 2


def _with_none_mask() -> Built:
    model, inputs = dense_decoder()
    return model, {**inputs, "attention_mask": None}


drop_constant_inputs = OpenVINOModelRule(
    RuleMeta(
        id="openvino/drop-constant-inputs",
        why="a non-tensor forward argument (use_cache=False, attention_mask=None) becomes a model input of "
        "dynamic rank and type, which the CPU plugin refuses to compile ('Parameter operation with dynamic "
        "rank'); torch.export already folded its value into the graph, so the input has no consumer",
        upstream="openvino==2026.4.1 frontend/pytorch/fx_decoder.py (one Parameter per placeholder of "
        "ExportedProgram.module(), ConstantArgument inputs included)",
        backends=("openvino",),
        # A Python constant of the forward (transformers' `use_cache=False`) stays an input of the converted model,
        # of dynamic rank, and the CPU plugin refuses to compile any model with one: every example export keeps it.
        baseline=True,
        examples=(
            Match(dense_decoder, "use_cache=False as a forward kwarg"),
            Match(_with_none_mask, "use_cache=False and attention_mask=None"),
            NoMatch(
                lambda: (_IgnoresAnInput(), {"x": torch.randn(2, 3), "unused": torch.randn(4)}),
                "an unread tensor input keeps its place",
            ),
        ),
    ),
    transform=drop_constant_parameters,
)
