"""PT2E-quantized programs on XNNPACK: no quantize of a dequantize with the same parameters.

`x.to(x.dtype)` is a no-op that PT2E still quantizes: `XNNPACKQuantizer` gives the cast its input's observer,
and `convert_pt2e` leaves `q(x, p) -> dq(_, p) -> to -> q(_, p) -> dq(_, p)`. LlamaRMSNorm ends in
`self.weight * hidden_states.to(input_dtype)`, so every Llama-style norm has one. The XNNPACK delegate turns the
`dq -> q` pair into a chain of two `convert` nodes, which XNNPACK's subgraph optimizer
(`xnn_subgraph_fuse_unary_quantized_into_lut`) fuses into a 256-entry lookup table. XNNPACK as built into
executorch 1.4.1 then frees that table twice: a temporary runtime the pass builds frees it while the method is
loaded (the lookup-table operator is then built from the freed memory: wrong values, logits cosine about 0.86
against fp32 on the tiny Llama instead of 0.998), and `xnn_delete_runtime` frees it again when the method is
destroyed, where glibc aborts the process ("free(): double free detected in tcache 2", "double free or
corruption"). The same bug, reached through WebNN, is Chromium issue 497456778, fixed in XNNPACK by
google/XNNPACK#9935 (April 2026).

The rule reads `q(dq(q(x, p), p), p)` (with no-op casts between) as `q(x, p)`: exact, since the int8 values
`q(x, p)` holds are on `p`'s grid, and quantizing their dequantized values with `p` gives them back.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from hfexport.rewrites.examples import Built, Match, NoMatch
from hfexport.rewrites.kinds.fx import NodeRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.executorch._pt2e import decomposed_op

aten = torch.ops.aten
_CASTS = (aten.to.dtype, aten._to_copy.default)


def _dtype(node: Any) -> torch.dtype | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value.dtype if isinstance(value, torch.Tensor) else None


def _is_noop_cast(node: fx.Node) -> bool:
    """`x.to(dtype)` / `_to_copy(x, dtype=...)` that keeps `x`'s dtype and changes nothing else it could."""
    if node.op != "call_function" or node.target not in _CASTS or not isinstance(node.args[0], fx.Node):
        return False
    if node.target is aten._to_copy.default and set(node.kwargs) - {"dtype"}:
        return False
    return _dtype(node) is not None and _dtype(node) == _dtype(node.args[0])


def _quantized_source(node: fx.Node) -> fx.Node | None:
    """For `q(cast*(dq(q0, p)), p)` with `q0 = q(_, p)`: `q0`; else None."""
    quantize, dequantize = decomposed_op("quantize_per_tensor"), decomposed_op("dequantize_per_tensor")
    if quantize is None or node.op != "call_function" or node.target is not quantize or node.kwargs:
        return None
    source = node.args[0]
    while isinstance(source, fx.Node) and _is_noop_cast(source):
        source = source.args[0]
    if not isinstance(source, fx.Node) or source.target is not dequantize or source.kwargs:
        return None
    params = tuple(node.args[1:6])  # scale, zero_point, quant_min, quant_max, dtype
    if tuple(source.args[1:6]) != params:
        return None
    # Only values a quantize with the same range wrote: an int8 constant could hold a value outside
    # [quant_min, quant_max], which the quantize would clamp.
    original = source.args[0]
    if not isinstance(original, fx.Node) or original.target is not quantize or original.kwargs:
        return None
    return original if tuple(original.args[1:6]) == params else None


def _is_identity_requantize(node: fx.Node) -> bool:
    return _quantized_source(node) is not None


def _drop_requantize(gm: fx.GraphModule, node: fx.Node) -> None:
    """The quantize's users read the first quantize; the cast and dequantize between go if nothing else reads
    them (the lowering's dead-code pass)."""
    node.replace_all_uses_with(_quantized_source(node))


# -- examples --------------------------------------------------------------------------------------------------------


class _RMSNorm(torch.nn.Module):
    """transformers' LlamaRMSNorm (weight * normalized x, cast back to the input dtype)."""

    def __init__(self, hidden_size: int = 32, eps: float = 1e-6) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.weight = torch.nn.Parameter(1.0 + 0.1 * torch.randn(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        hidden = x.to(torch.float32)
        variance = hidden.pow(2).mean(-1, keepdim=True)
        hidden = hidden * torch.rsqrt(variance + self.eps)
        return self.weight * hidden.to(input_dtype)


class _Requantize(torch.nn.Module):
    """Explicit quantize/dequantize pairs: `q(dq(q(x, first)), second)`, then a multiply in int8."""

    def __init__(self, second: tuple[float, int]) -> None:
        super().__init__()
        self.second = second

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import torchao.quantization.pt2e  # noqa: F401 - registers the quantized_decomposed ops

        ops = torch.ops.quantized_decomposed

        def qdq(t: torch.Tensor, scale: float, zero_point: int) -> torch.Tensor:
            q = ops.quantize_per_tensor.default(t, scale, zero_point, -128, 127, torch.int8)
            return ops.dequantize_per_tensor.default(q, scale, zero_point, -128, 127, torch.int8)

        h = qdq(qdq(x, 0.02, 3), *self.second)
        return qdq(h * qdq(x, 0.02, 3), 0.05, 0)


def _quantized(module: torch.nn.Module) -> Built:
    """`module` as `PT2EQuantizer(XNNPACKQuantizer(...))` leaves it (per-tensor symmetric int8), calibrated."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from hfexport.rewrites.rules.executorch._pt2e import QuantizedProgram

    inputs = {"x": torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(0))}
    with torch.no_grad():
        graph_module = torch.export.export(module.eval(), (), inputs, strict=False).module()
        prepared = prepare_pt2e(graph_module, XNNPACKQuantizer().set_global(get_symmetric_quantization_config()))
        prepared(**inputs)
        return QuantizedProgram(convert_pt2e(prepared)), inputs


quant_identity_requantize = NodeRule(
    RuleMeta(
        id="executorch/quant-identity-requantize",
        why="XNNPACK (in executorch 1.4.1) frees the lookup table it fuses a quantized dequantize -> quantize pair "
        "into twice: a PT2E-quantized LlamaRMSNorm ('.to(input_dtype)' quantized with its input's parameters) "
        "loads and runs from freed memory, and the process aborts when the method is destroyed ('double free "
        "or corruption'). A quantize of a dequantize with the same parameters is the identity on the int8 "
        "values; its users read the first quantize instead (exact)",
        upstream="https://github.com/google/XNNPACK/pull/9935 (double free in "
        "xnn_subgraph_fuse_unary_quantized_into_lut, Chromium issue 497456778; executorch 1.4.1 predates it, main "
        "vendors it since pytorch/executorch#21400, for 1.5.0)",
        expires="executorch>=1.5.0",
        backends=("executorch",),
        needed="tests/rewrites/test_quant_rules.py runs it in a child process: without the rule XNNPACK frees a "
        "buffer twice and aborts the process",
        models=("llama", "qwen3_moe"),
        examples=(
            Match(
                lambda: _quantized(_RMSNorm()),
                "quantized LlamaRMSNorm: the no-op cast to the input dtype between two quantizes",
                # XNNPACK's int8 kernels round where the reference quantize/dequantize simulation does not:
                # they agree to about one step of the output's scale, not bit for bit.
                atol=2e-2,
            ),
            Match(lambda: (_Requantize((0.02, 3)), {"x": torch.randn(2, 8, 32)}), "q(dq(q(x)))", atol=6e-2),
            NoMatch(
                lambda: (_Requantize((0.03, -2)), {"x": torch.randn(2, 8, 32)}),
                "a requantize to other parameters (not the identity)",
            ),
            NoMatch(lambda: (_RMSNorm(), {"x": torch.randn(2, 8, 32)}), "the norm in float: no quantize"),
        ),
    ),
    predicate=_is_identity_requantize,
    rewrite=_drop_requantize,
)
