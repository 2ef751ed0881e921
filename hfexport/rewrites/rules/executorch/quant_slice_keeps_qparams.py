"""PT2E-quantized programs (`PT2EQuantizer(XNNPACKQuantizer(...))`) on ExecuTorch's XNNPACK backend.

XNNPACK's static slice requires its quantized output to have its input's scale and zero point. executorch 1.4.1's
`XNNPACKQuantizer` shares observers for `slice_copy` but not for `aten.slice.Tensor`, the op it sees before
`to_edge`, so a slice gets its own output parameters: in rotary embeddings' `rotate_half`
(`cat((-x[..., d:], x[..., :d]))`) one slice feeds the float `neg`, the other the `cat` with the `cat`'s
parameters. The program lowers, and fails to load: "Failed to create static slice node ... with code:
xnn_status_invalid_parameter".
"""

from __future__ import annotations

import torch
from torch import fx

from hfexport.rewrites.examples import Built, Match, NoMatch
from hfexport.rewrites.kinds.fx import NodeRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.executorch._pt2e import QuantizedProgram, decomposed_op

aten = torch.ops.aten
_SLICES = (aten.slice.Tensor, aten.slice_copy.Tensor)


def _is_slice_changing_qparams(node: fx.Node) -> bool:
    """`slice(dequantize_per_tensor(q, params))` with a user that is not `quantize_per_tensor(_, params)`: a float
    op, or a quantize with other parameters."""
    if node.op != "call_function" or node.target not in _SLICES:
        return False
    source = node.args[0]
    dequantize = decomposed_op("dequantize_per_tensor")
    if not isinstance(source, fx.Node) or dequantize is None or source.target is not dequantize:
        return False
    quantize = decomposed_op("quantize_per_tensor")
    params = tuple(source.args[1:6])
    return any(user.target is not quantize or tuple(user.args[1:6]) != params for user in node.users)


def _requantize_slice(gm: fx.GraphModule, node: fx.Node) -> None:
    """`slice(dq(q))` -> `dq(q(slice(dq(q))))` with the dequantize's own scale and zero point: the slice's values
    are on that grid already, so quantizing them again is exact, and XNNPACK sees a quantized slice."""
    dequantize = node.args[0]
    params = tuple(dequantize.args[1:6])  # scale, zero_point, quant_min, quant_max, dtype
    users = list(node.users)
    graph = gm.graph
    with graph.inserting_after(node):
        quantized = graph.call_function(decomposed_op("quantize_per_tensor"), (node, *params))
    with graph.inserting_after(quantized):
        back = graph.call_function(dequantize.target, (quantized, *params), dict(dequantize.kwargs))
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor):
        quantized.meta["val"] = value.to(params[4])
        back.meta["val"] = value
    for key in ("nn_module_stack", "stack_trace"):
        if key in node.meta:
            quantized.meta[key] = back.meta[key] = node.meta[key]
    for user in users:
        user.replace_input_with(node, back)


# -- examples --------------------------------------------------------------------------------------------------------


class _RotateHalf(torch.nn.Module):
    """Linear, then `rotate_half` (transformers' rotary embedding) on 4 heads, then another linear."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.project = torch.nn.Linear(32, 32)
        self.out = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        h = self.project(x).view(batch, length, 4, 8).transpose(1, 2)
        h = torch.cat((-h[..., 4:], h[..., :4]), dim=-1)
        return self.out(h.transpose(1, 2).reshape(batch, length, 32))


class _SharedSlice(torch.nn.Module):
    """A quantized slice whose output keeps its input's scale and zero point (what XNNPACKQuantizer writes once
    it shares a slice's observer, executorch PR 21568)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torchao.quantization.pt2e  # noqa: F401 - registers the quantized_decomposed ops

        ops = torch.ops.quantized_decomposed
        params = (0.05, 3, -128, 127, torch.int8)
        h = ops.dequantize_per_tensor.default(ops.quantize_per_tensor.default(x, *params), *params)
        h = h[:, 2:]
        return ops.dequantize_per_tensor.default(ops.quantize_per_tensor.default(h, *params), *params) * 2.0


def _quantized() -> Built:
    """The module as `PT2EQuantizer(XNNPACKQuantizer(...))` leaves it (per-tensor symmetric int8), calibrated."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    inputs = {"x": torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))}
    module = _RotateHalf().eval()
    with torch.no_grad():
        graph_module = torch.export.export(module, (), inputs, strict=False).module()
        prepared = prepare_pt2e(graph_module, XNNPACKQuantizer().set_global(get_symmetric_quantization_config()))
        prepared(**inputs)
        return QuantizedProgram(convert_pt2e(prepared)), inputs


quant_slice_keeps_qparams = NodeRule(
    RuleMeta(
        id="executorch/quant-slice-keeps-qparams",
        why="XNNPACK fails to load a PT2E-quantized program whose slices change quantization parameters (rotary "
        "embeddings' rotate_half under XNNPACKQuantizer: 'Failed to create static slice node ... "
        "xnn_status_invalid_parameter'). Each such slice is quantized again with its input's parameters (exact), "
        "and the original quantize follows",
        upstream="https://github.com/pytorch/executorch/pull/21568 (XNNPACKQuantizer shares the observer of "
        "aten.slice.Tensor; merged for 1.5.0, not in 1.4.1); https://github.com/pytorch/executorch/issues/21829",
        expires="executorch>=1.5.0",
        backends=("executorch",),
        models=("llama", "nncf-pt2e-xnnpack"),
        examples=(
            # XNNPACK's int8 kernels round where the reference quantize/dequantize simulation does not: the two
            # agree to about one step of the output's scale (0.009 here), not bit for bit.
            Match(
                _quantized,
                "quantized rotate_half: a slice to a float neg, a slice to cat with another zero point",
                atol=2e-2,
            ),
            NoMatch(lambda: (_SharedSlice(), {"x": torch.randn(4, 6)}), "a quantized slice with its input's qparams"),
            NoMatch(lambda: (_RotateHalf(), {"x": torch.randn(2, 8, 32)}), "rotate_half in float: no dequantize"),
        ),
    ),
    predicate=_is_slice_changing_qparams,
    rewrite=_requantize_slice,
)
