"""Program outputs as the OpenVINO PyTorch frontend names them."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import fx
from torch._guards import detect_fake_mode

from hfexport.rewrites.example_models import dense_decoder
from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.fx import NodeRule
from hfexport.rewrites.rule import RuleMeta

aten = torch.ops.aten


def _repeats(node: fx.Node) -> list[int]:
    """Positions of the program outputs that repeat an earlier output value (tensor or SymInt), or that return a
    program input unchanged."""
    if node.op != "output" or not isinstance(node.args[0], (tuple, list)):
        return []
    seen: set[fx.Node] = set()
    repeats = []
    for i, value in enumerate(node.args[0]):
        if not isinstance(value, fx.Node):
            continue
        val = value.meta.get("val")
        repeated = value in seen and isinstance(val, (torch.Tensor, torch.SymInt))
        if repeated or (value.op == "placeholder" and isinstance(val, torch.Tensor)):
            repeats.append(i)
        seen.add(value)
    return repeats


def _distinct_copy(graph: fx.Graph, value: fx.Node) -> fx.Node:
    """A new node with the same value as `value`, that the converter gives its own tensor."""
    val = value.meta["val"]
    if isinstance(val, torch.SymInt):
        # A SymInt cannot be copied: `openvino.convert_model` retraces the program first, and the retrace folds
        # every expression equal to the symbol (s * 1, a second sym_size) back into one node. A 0-d int64
        # tensor of the same value is what OpenVINO returns for a SymInt output anyway.
        copy = graph.call_function(aten.scalar_tensor.default, (value,), {"dtype": torch.int64})
        fake_mode = detect_fake_mode([n.meta.get("val") for n in graph.nodes if n.op == "placeholder"])
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            copy.meta["val"] = torch.empty((), dtype=torch.int64)
        return copy
    if val.dtype == torch.bool:
        copy = graph.call_function(aten.logical_and.default, (value, value))
        copy.meta["val"] = aten.logical_and.default(val, val)
    else:
        # x * 1 is x exactly for every int and float (-0.0, inf and NaN included); clone / alias / detach are
        # translated as their input itself and would leave the two outputs on one tensor.
        copy = graph.call_function(aten.mul.Tensor, (value, 1))
        copy.meta["val"] = aten.mul.Tensor(val, 1)
    return copy


def _copy_repeated_outputs(gm: fx.GraphModule, node: fx.Node) -> None:
    outputs = list(node.args[0])
    graph = gm.graph
    with graph.inserting_before(node):
        for i in _repeats(node):
            outputs[i] = _distinct_copy(graph, outputs[i])
    node.args = (type(node.args[0])(outputs), *node.args[1:])


class _ReturnsTwice(torch.nn.Module):
    """One tensor and one size returned twice, as two cache layers that share their keys and length do."""

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> tuple[Any, ...]:
        y = x[:, 1:] * 2
        gate = keep > 0
        return y, x.shape[1], y, x.shape[1], gate, gate, x, x


def _returns_twice(length: int, batch: int = 2) -> dict[str, torch.Tensor]:
    return {"x": torch.randn(batch, length), "keep": torch.randn(batch, length)}


class _ReturnsInput(torch.nn.Module):
    """An input returned unchanged beside a result, as an encoder's hidden states or an unused cache layer are."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, mask


class _ReturnsOnce(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x * 2


distinct_repeated_outputs = NodeRule(
    RuleMeta(
        id="openvino/distinct-repeated-outputs",
        why='openvino.convert_model fails with "Tensor name is not a number: slice" (or sym, add...) when the '
        "program returns one value at two output positions: it strips the numeric name of each output tensor "
        "once per Result, so the second Result of the same tensor finds only its debug name. Cache layers "
        "that share keys or a length (exaone4, exaone_moe, deepseek_v4) do that. An output that is a program "
        "input passed through is the same tensor as the Parameter: naming the output renames the input, and "
        "after save_model/read_model the input keeps only the output's name, so no feed by input name works. "
        "Each repeat, and each input returned, becomes its own node of the same value",
        upstream="openvino==2026.4.1 src/frontends/pytorch/src/translate_session.cpp "
        "(TranslateSession::translate_graph erases the index name of every Result's tensor, then decode_tensor_name "
        "checks is_number; no issue filed found)",
        backends=("openvino",),
        models=("exaone4", "exaone_moe", "deepseek_v4"),
        examples=(
            Match(
                lambda: (_ReturnsTwice(), _returns_twice(5)),
                "a float tensor, a size, a bool tensor and an input, each returned twice; then another shape",
                other_inputs=lambda: _returns_twice(9, batch=3),
            ),
            Match(
                lambda: (_ReturnsInput(), {"x": torch.randn(2, 5), "mask": torch.rand(2, 5) > 0.5}),
                "a bool input returned unchanged once; then another shape",
                other_inputs=lambda: {"x": torch.randn(3, 9), "mask": torch.rand(3, 9) > 0.5},
            ),
            NoMatch(lambda: (_ReturnsOnce(), {"x": torch.randn(2, 3)}), "two outputs of equal value, two nodes"),
            NoMatch(dense_decoder, "a Llama forward"),
        ),
    ),
    predicate=lambda node: bool(_repeats(node)),
    rewrite=_copy_repeated_outputs,
)
