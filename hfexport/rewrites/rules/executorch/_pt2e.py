"""PT2E helpers shared by `hfexport.quantizers.pt2e.PT2EQuantizer` and the ExecuTorch rules on quantized programs
(their rewrites and the examples that quantize a model with `XNNPACKQuantizer` themselves); they sit with the
rules so that both import them downward.

- `decomposed_op`: a `quantized_decomposed` operator overload, or None where PT2E was never imported.
- `restore_integer_constants` / `keeping_integer_constants`: integer constants of a graph that ExecuTorch's
  `XNNPACKQuantizer` turned into float, given back before annotation.
- `QuantizedProgram`: the examples' module around a converted PT2E program.
"""

from __future__ import annotations

from typing import Any

import torch


def decomposed_op(name: str, overload: str = "default") -> Any:
    """`torch.ops.quantized_decomposed.<name>.<overload>`, or None. Those ops are registered when torchao's (or
    torch.ao's) PT2E quantization is imported, which a program that holds them has done."""
    namespace = getattr(torch.ops, "quantized_decomposed", None)
    return getattr(getattr(namespace, name, None), overload, None)


_ARITHMETIC = ("add.Tensor", "sub.Tensor", "mul.Tensor")


def restore_integer_constants(model: torch.fx.GraphModule) -> int:
    """Give back their integer dtype to scalar constants of integer arithmetic; return how many were changed.

    ExecuTorch's XNNPACKQuantizer turns scalar operands into float tensor attributes before annotating
    (executorch 1.4.1). In the index arithmetic of transformers' mask creation (`arange + offset`) that makes
    the result float, and the calibration run fails ("tensors used as indices must be long, ...").
    """
    changed = 0
    for node in model.graph.nodes:
        if node.op != "call_function" or not str(node.target).endswith(_ARITHMETIC):
            continue
        args = [a for a in node.args if isinstance(a, torch.fx.Node)]
        integers = [a for a in args if getattr(a.meta.get("val"), "dtype", torch.float32) in _INTEGER]
        for arg in args:
            if arg.op != "get_attr" or not integers:
                continue
            value = getattr(model, str(arg.target), None)
            if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.numel() != 1:
                continue
            dtype = integers[0].meta["val"].dtype
            if value.to(dtype).to(value.dtype).equal(value):
                setattr(model, str(arg.target), value.to(dtype))
                changed += 1
    return changed


_INTEGER = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def keeping_integer_constants(quantizer: Any) -> Any:
    """`quantizer` seen through a delegate whose `transform_for_annotation` also restores integer constants."""
    from torchao.quantization.pt2e.quantizer import Quantizer

    class KeepingIntegerConstants(Quantizer):
        def transform_for_annotation(self, model: torch.fx.GraphModule) -> torch.fx.GraphModule:
            model = quantizer.transform_for_annotation(model)
            if restore_integer_constants(model):
                model.recompile()
            return model

        def annotate(self, model: torch.fx.GraphModule) -> torch.fx.GraphModule:
            return quantizer.annotate(model)

        def validate(self, model: torch.fx.GraphModule) -> None:
            quantizer.validate(model)

        def prepare_obs_or_fq_callback(self, model: torch.fx.GraphModule, edge_or_node_to_obs_or_fq: Any) -> None:
            quantizer.prepare_obs_or_fq_callback(model, edge_or_node_to_obs_or_fq)

    return KeepingIntegerConstants()


class QuantizedProgram(torch.nn.Module):
    """An example model: a converted PT2E GraphModule; `eval()` leaves it alone (it refuses `train()` / `eval()`)."""

    def __init__(self, graph_module: torch.nn.Module) -> None:
        super().__init__()
        self.quantized = graph_module

    def train(self, mode: bool = True) -> QuantizedProgram:
        self.training = mode
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quantized(x=x)
