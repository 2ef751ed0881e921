"""Dynamically quantized programs on XNNPACK: one dynamic quantization chain per consumer.

`XNNPACKQuantizer` with `is_dynamic=True` quantizes a linear's activation at run time: `convert_pt2e` leaves
`choose_qparams(x) -> quantize(x, s, zp) -> dequantize(_, s, zp) -> linear`. Where several linears read the same
activation (a transformer's q/k/v projections after the input norm, the gate and up projections after the
post-attention norm), the quantizer annotates the activation once, so one chain feeds all of them. XNNPACK's
partitioner gives each dynamically quantized linear its own partition that must hold its chain; a chain shared by
several partitions makes the group partitioner merge them across the attention between, and
`to_edge_transform_and_lower` fails: "AssertionError: Invalid partition, found dependency cycles" (executorch
1.4.1, a 1- or 2-layer Llama quantized with `get_symmetric_quantization_config(is_per_channel=True,
is_dynamic=True)` and exported with dynamic shapes; the same model with static shapes lowers, and so do smaller
modules with a shared chain, so the cycle needs the symbolic-size nodes of a whole decoder layer between the
partitions). executorch's own Llama flow runs its `DuplicateDynamicQuantChainPass` after `convert_pt2e` for this.

The rule gives every consumer after the first its own copy of the chain, inserted just before it. Exact: each copy
computes the same parameters from the same activation and quantizes it the same way.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from hfexport.rewrites.example_models import tiny_model
from hfexport.rewrites.examples import Built, Match, NoMatch
from hfexport.rewrites.kinds.fx import NodeRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.executorch._pt2e import QuantizedProgram, decomposed_op


def _chain(node: fx.Node) -> tuple[fx.Node, fx.Node, fx.Node, fx.Node] | None:
    """For `dequantize(quantize(x, s, zp), s, zp)` whose `s`, `zp` are the two items of `choose_qparams(x)`:
    (choose_qparams, scale item, zero-point item, quantize); else None."""
    dequantize = decomposed_op("dequantize_per_tensor", "tensor")
    quantize = decomposed_op("quantize_per_tensor", "tensor")
    choose = decomposed_op("choose_qparams", "tensor")
    if dequantize is None or node.op != "call_function" or node.target is not dequantize or node.kwargs:
        return None
    source = node.args[0]
    if not isinstance(source, fx.Node) or source.target is not quantize or source.kwargs:
        return None
    scale, zero_point = source.args[1], source.args[2]
    if tuple(node.args[1:]) != tuple(source.args[1:]):
        return None
    items = []
    for item, index in ((scale, 0), (zero_point, 1)):
        if not isinstance(item, fx.Node) or item.target is not operator.getitem:
            return None
        parent, position = item.args
        if not isinstance(parent, fx.Node) or parent.target is not choose or position != index:
            return None
        items.append(parent)
    if items[0] is not items[1] or items[0].args[0] is not source.args[0]:
        return None
    return items[0], scale, zero_point, source


def _is_shared_dynamic_chain(node: fx.Node) -> bool:
    return len(node.users) > 1 and _chain(node) is not None


def _copy(graph: fx.Graph, node: fx.Node, args: tuple[Any, ...]) -> fx.Node:
    clone = graph.call_function(node.target, args, dict(node.kwargs))
    clone.meta = {key: value for key, value in node.meta.items() if key in ("val", "tensor_meta", "stack_trace")}
    return clone


def _chain_per_consumer(gm: fx.GraphModule, node: fx.Node) -> None:
    """Every user of the shared dequantize after the first reads a copy of the whole chain, built just before it."""
    choose, scale, zero_point, quantize = _chain(node)
    for user in list(node.users)[1:]:
        with gm.graph.inserting_before(user):
            new_choose = _copy(gm.graph, choose, choose.args)
            new_scale = _copy(gm.graph, scale, (new_choose, 0))
            new_zero_point = _copy(gm.graph, zero_point, (new_choose, 1))
            rest = quantize.args[3:]
            new_quantize = _copy(gm.graph, quantize, (quantize.args[0], new_scale, new_zero_point, *rest))
            new_dequantize = _copy(gm.graph, node, (new_quantize, new_scale, new_zero_point, *node.args[3:]))
        user.replace_input_with(node, new_dequantize)


# -- examples --------------------------------------------------------------------------------------------------------


class _QuantizedLM(QuantizedProgram):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.quantized(input_ids=input_ids, use_cache=False).logits


class _QuantizedPair(QuantizedProgram):
    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.quantized(x=x, y=y)


class _Projections(torch.nn.Module):
    """`a(x) * b(x) + c(y)`: x's chain shared by two linears, y's read by one; with `shared=False`,
    `b(gelu(a(x))) + c(y)`: every chain read by one linear."""

    def __init__(self, shared: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.shared = shared
        self.a, self.b, self.c = (torch.nn.Linear(16, 16, bias=False) for _ in range(3))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.shared:
            return self.a(x) * self.b(x) + self.c(y)
        return self.b(torch.nn.functional.gelu(self.a(x))) + self.c(y)


def _dynamic_quantized(module: torch.nn.Module, inputs: dict[str, Any], wrap: type[QuantizedProgram]) -> Built:
    """`module` as `PT2EQuantizer(XNNPACKQuantizer(...is_dynamic=True))` leaves it: int8 per-channel weights,
    activations quantized at run time."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from hfexport.rewrites.rules.executorch._pt2e import keeping_integer_constants

    quantizer = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True, is_dynamic=True))
    with torch.no_grad():
        # Every tensor axis symbolic, as the export's `dynamic=True` captures it before quantizing.
        dynamic = {
            k: {i: torch.export.Dim.AUTO for i in range(v.dim())} if isinstance(v, torch.Tensor) else None
            for k, v in inputs.items()
        }
        graph_module = torch.export.export(module.eval(), (), inputs, dynamic_shapes=dynamic, strict=False).module()
        prepared = prepare_pt2e(graph_module, keeping_integer_constants(quantizer))
        prepared(**inputs)
        converted = convert_pt2e(prepared)
    return wrap(converted), {k: v for k, v in inputs.items() if k != "use_cache"}


def _llama() -> Built:
    model, inputs = tiny_model(
        "LlamaConfig",
        "LlamaForCausalLM",
        tokens=6,
        batch=2,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return _dynamic_quantized(model, inputs, wrap=_QuantizedLM)


def _projections(shared: bool) -> Built:
    generator = torch.Generator().manual_seed(0)
    inputs = {"x": torch.randn(2, 5, 16, generator=generator), "y": torch.randn(2, 5, 16, generator=generator)}
    return _dynamic_quantized(_Projections(shared), inputs, wrap=_QuantizedPair)


quant_dynamic_chain_per_consumer = NodeRule(
    RuleMeta(
        id="executorch/quant-dynamic-chain-per-consumer",
        why="A dynamically quantized activation read by several linears (q/k/v after the input norm, gate/up after "
        "the post-attention norm) has one choose_qparams -> quantize -> dequantize chain after convert_pt2e; "
        "XNNPACK's partitioner needs a chain per dynamically quantized linear, and a shared one fails the lowering "
        "('Invalid partition, found dependency cycles', executorch 1.4.1, Llama with XNNPACKQuantizer "
        "is_dynamic=True, exported with dynamic shapes). Each consumer after the first gets its own copy of the "
        "chain (exact: the same parameters from the same activation)",
        upstream="executorch==1.4.1 backends/transforms/duplicate_dynamic_quant_chain.py "
        "DuplicateDynamicQuantChainPass "
        "(executorch's Llama export runs it after convert_pt2e; XNNPACKQuantizer users elsewhere must; "
        "pytorch/executorch#18397, the group partitioner's cycle fix in 1.4.1, does not cover this case)",
        backends=("executorch",),
        models=("llama",),
        examples=(
            Match(lambda: _projections(True), "a(x) * b(x) + c(y): x's chain read by two linears", atol=5e-2),
            Match(
                _llama,
                "a one-layer Llama with dynamic int8 activations, exported with dynamic shapes: q/k/v and gate/up "
                "share their norm's chain",
                other_inputs=lambda: {
                    "input_ids": torch.randint(0, 64, (3, 11), generator=torch.Generator().manual_seed(2))
                },
                # XNNPACK's dynamically quantized kernels round where the reference quantize/dequantize
                # simulation does not: they agree to about one step of the activation's scale.
                atol=5e-2,
            ),
            NoMatch(lambda: _projections(False), "b(gelu(a(x))) + c(y): every chain read by one linear"),
        ),
    ),
    predicate=_is_shared_dynamic_chain,
    rewrite=_chain_per_consumer,
)
