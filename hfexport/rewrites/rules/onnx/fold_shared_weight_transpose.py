"""A weight read through a `Transpose` and also by another node (tied embeddings) becomes its own transposed
initializer (stage `onnx`, a fix run before the optimizer; opt-in, switched on by `NNCFOnnxQuantizer` and
`OnnxRuntimeQuantizer`).

torch.onnx translates `linear(x, W)` as `MatMul(x, Transpose(W))`. The onnxscript optimizer folds that
`Transpose` into a new initializer when it is the weight's only reader, but a tied head (`lm_head.weight` is
`embed_tokens.weight`: SmolLM2, Llama-3.2, Qwen3 small) also feeds the embedding's `Gather`, and a shared
weight above the folding size limit keeps its runtime `Transpose`. NNCF's ONNX graph builder finds the weight
of such a MatMul by walking through the `Transpose` to the initializer, but records the MatMul's own input
(the Transpose's output, `val_…`) as the weight's name, and `nncf.compress_weights` then stops with "There is
no tensor with the name val_…". ONNX Runtime's quantization tool quantizes a MatMul only where its weight is an
initializer, so the tied head stayed float in an `OnnxRuntimeQuantizer` export (the largest matmul of a small
LM).

The rule gives that MatMul its own initializer, `W` transposed (the same values, so the graph computes exactly
what it did), and leaves the original to its other readers. The cost is a second copy of the shared weight in
the file, which is why it is opt-in: ONNX Runtime folds the same `Transpose` when a session starts anyway, so
a full-precision export gains nothing from it; a quantizer turns the copy into int4/int8 (NNCFOnnxQuantizer and
OnnxRuntimeQuantizer switch it on).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.onnx import OnnxRewriteRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules._tied_head import TiedHead, UntiedHead, token_ids


def _shared_initializer(value: Any) -> bool:
    """`value` is a rank-2 graph initializer with a known value that more than one node reads."""
    return (
        value.is_initializer()
        and value.const_value is not None
        and value.shape is not None
        and value.shape.rank() == 2
        and len(value.uses()) > 1
    )


def _unique_name(value: Any) -> str:
    graph = value.graph
    taken = set(graph.initializers) if graph is not None else set()
    name, index = f"{value.name}.transposed", 1
    while name in taken:
        index += 1
        name = f"{value.name}.transposed.{index}"
    return name


# `Value.meta` key of a transposed copy made of a lazy (streamed) weight: the weight's initializer name.
TRANSPOSED_FROM = "hfexport.transposed_from"


def _transposed(source: Any, name: str) -> Any:
    import onnx_ir as ir

    return ir.tensor(source.numpy().T.copy(), name=name)


def _rule() -> Any:
    import onnx_ir as ir
    from onnxscript.rewriter import pattern

    class FoldSharedWeightTranspose(pattern.RewriteRuleClassBase):
        def pattern(self, op: Any, weight: Any) -> Any:
            return op.Transpose(weight, _allow_other_attributes=True, _outputs=["transposed"])

        def check(self, context: Any, weight: Any, transposed: Any, **_: Any) -> Any:
            result = pattern.MatchResult()
            if not _shared_initializer(weight):
                return result.fail("not a rank-2 initializer that another node also reads", weight)
            perm = transposed.producer().attributes.get("perm")
            if perm is not None and list(perm.as_ints()) != [1, 0]:
                return result.fail("a permutation other than the rank-2 swap", weight)
            return result

        def rewrite(self, op: Any, weight: Any, transposed: Any, **_: Any) -> Any:
            name = _unique_name(weight)
            source = weight.const_value
            if isinstance(source, ir.LazyTensor):
                # A low-memory export's streamed weight (read from the checkpoint when written): the copy is
                # transposed when written too, so the weight is never held; `TRANSPOSED_FROM` says of which.
                shape = ir.Shape(list(reversed(source.shape.dims)))
                read = functools.partial(_transposed, source, name)
                value = op.initializer(ir.LazyTensor(read, dtype=source.dtype, shape=shape, name=name), name=name)
                value.meta[TRANSPOSED_FROM] = weight.name
                return value
            return op.initializer(_transposed(source, name), name=name)

    return FoldSharedWeightTranspose.rule()


# -- examples --------------------------------------------------------------------------------------


def _tied() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    # 1024 x 16: large enough that the optimizer's size limit keeps the Transpose.
    return TiedHead(1024), token_ids(1024)


def _untied() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    # The optimizer folds this head's Transpose: nothing else reads its weight.
    return UntiedHead(1024), token_ids(1024)


fold_shared_weight_transpose = OnnxRewriteRule(
    meta=RuleMeta(
        id="onnx/fold-shared-weight-transpose",
        why="NNCFOnnxQuantizer failed on tied embeddings (SmolLM2, Llama-3.2) with 'There is no tensor with the name "
        "val_…': NNCF reads the head's weight under the name of its Transpose's output. OnnxRuntimeQuantizer left "
        "the tied head in float (onnxruntime.quantization quantizes a MatMul only on an initializer weight): 89 of "
        "138 ms of a 2-layer SmolLM2-shaped int8 decode step (ORT profile)",
        upstream="nncf==3.4.0 nncf/onnx/graph/nncf_graph_builder.py GraphConverter (weight_attrs name is "
        "node.input[port], while get_tensor_edge_name follows Transpose to the initializer)",
        backends=("onnx",),
        needed="tests/rewrites/test_quant_rules.py shows it: without the rule NNCFOnnxQuantizer fails on a tied head; "
        "without a quantizer nothing needs it",
        models=("llama", "qwen3", "nncf-onnx", "ort-quantization"),
        kind="fix",
        enabled_by_default=False,
        examples=(
            Match(
                _tied,
                "a tied output projection (the embedding's weight, 1024 x 16): its own transposed copy",
            ),
            NoMatch(
                _untied,
                "a head with its own weight",
                reason="nothing else reads the head's weight (the optimizer folds that Transpose itself)",
            ),
        ),
    ),
    rewrite_rule=_rule,
)
