"""Edge-dialect copies that change nothing: a slice that keeps its whole axis, an expand or a view to the same shape.

The edge dialect has no views: `x[:, :]` becomes `slice_copy` and the `expand` that `matmul`'s decomposition puts
in front of each `bmm` operand becomes `expand_copy`, even when the shape does not change. XNNPACK takes neither, so
each is a portable-kernel copy of its whole input. In a static-cache decode step those inputs are the cache: per
layer the full slice of each written cache (`StaticLayer.update` returns `keys[:, :]`-style views in the captured
graph) and the no-op expand of the keys and values before the attention's two matmuls, four copies of a
`batch x kv_heads x slots x head_dim` tensor per layer and step. Each such copy's output is its input's values in
the input's shape, so its users read the input instead.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from hfexport.rewrites.examples import Built, Match, NoMatch
from hfexport.rewrites.kinds.executorch import ExecutorchEdgePassRule, bypass_nodes
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules._aten_graph import SDPA, is_full_slice

_ops = torch.ops.aten
# Edge copies that may leave the shape as it is.
_COPIES = (_ops.slice_copy.Tensor, _ops.expand_copy.default, _ops.view_copy.default)


def _target(node: fx.Node) -> Any:
    # Edge-dialect ops wrap the ATen overload in `_op`.
    return getattr(node.target, "_op", node.target)


def _shape(node: Any) -> list[str] | None:
    value = getattr(node, "meta", {}).get("val")
    return [str(s) for s in value.shape] if isinstance(value, torch.Tensor) else None


def _times_one(node: fx.Node) -> bool:
    # `x * 1.0` (SDPA's decomposition scales the keys by sqrt(scale), 1 when the query took the scale): the same
    # values for every float, -0.0, inf and nan included; the dtype check below keeps out a promoting product.
    return _target(node) in (_ops.mul.Scalar, _ops.mul.Tensor) and len(node.args) == 2 and node.args[1] == 1


def _identity(node: fx.Node) -> bool:
    """A copy op (or a product by one) whose output has its input's shape and dtype: the same values."""
    if node.op != "call_function" or not node.args or not (_target(node) in _COPIES or _times_one(node)):
        return False
    source = node.args[0]
    if not isinstance(source, fx.Node):
        return False
    if _target(node) is _ops.slice_copy.Tensor and len(node.args) > 4 and node.args[4] != 1:
        return False  # a strided slice of the same length cannot exist, but say so
    out, into = node.meta.get("val"), source.meta.get("val")
    if not isinstance(out, torch.Tensor) or not isinstance(into, torch.Tensor) or out.dtype != into.dtype:
        return False
    # Not an output that would then alias a program input (the runtime owns those buffers).
    if source.op == "placeholder" and any(user.op == "output" for user in node.users):
        return False
    return _shape(node) == _shape(source)


def drop_same_shape_copies(gm: fx.GraphModule) -> Any:
    """Let every user of an identity copy read the copy's input; return a `PassResult`."""
    return bypass_nodes(gm, lambda node: node.args[0] if _identity(node) else None)


def _batched_matmul(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target not in (_ops.matmul.default, SDPA) or not node.args:
        return False
    value = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dim() >= 4


def count_identity_copies(program: torch.export.ExportedProgram) -> int:
    """The captured program's ops that `to_edge` turns into same-shape copies: full slices and batched matmuls
    (SDPA's included) over 4-D or wider operands."""
    return sum(1 for node in program.graph.nodes if is_full_slice(node) or _batched_matmul(node))


def _edge_passes() -> list[Any]:
    return [drop_same_shape_copies]


class _CachedAttention(torch.nn.Module):
    """Attention of new queries over a whole cache read through a full slice, as a static-cache layer does."""

    def __init__(self, scaled: bool = True) -> None:
        super().__init__()
        self.scaled = scaled

    def forward(self, query: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        keys = cache[:, :]
        if self.scaled:
            # Queries see the slots up to their own (the cache holds them at its end), as a decode step's mask.
            slots, tokens = keys.shape[2], query.shape[2]
            mask = torch.arange(slots)[None, :] <= torch.arange(slots - tokens, slots)[:, None]
            values = keys.flip(-1)
            return torch.nn.functional.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=0.5)
        return (query @ keys.transpose(-1, -2)).softmax(-1) @ keys


def _inputs(batch: int = 2, tokens: int = 3, slots: int = 8, seed: int = 0) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "query": torch.randn(batch, 2, tokens, 4, generator=generator),
        "cache": torch.randn(batch, 2, slots, 4, generator=generator),
    }


class _Flat(torch.nn.Module):
    """2-D work only: no slice, no batched matmul."""

    def forward(self, query: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        return (query.flatten(0, 2) @ cache.flatten(0, 2).T).softmax(-1)


def _built(scaled: bool = True) -> Built:
    return _CachedAttention(scaled), _inputs()


drop_identity_copies = ExecutorchEdgePassRule(
    RuleMeta(
        id="executorch/drop-identity-copies",
        kind="optimization",
        why="The edge dialect has no views: a full slice (`keys[:, :]`) becomes slice_copy, and matmul's "
        "decomposition (SDPA's too) expands each 4-D operand to its own shape, an expand_copy; XNNPACK takes "
        "neither, so the SmolLM2-135M decode program copied each layer's key and value cache twice more per step "
        "(slice_copy x2 and expand_copy x2 per layer outside the delegate, 4 x 196 KB, about 24 MB a token at 30 "
        "layers). A copy whose output has its input's shape and dtype is its input's values: users read the input "
        "(with executorch/grouped-sdpa-without-repeat-kv: 30-layer decode 21.4 -> 44.3 tok/s)"
        "; measured by tools/ab_rules.py (the executorch-static-decode form, 4 layers at "
        "SmolLM2-135M's width, batch 1, 128-token prompt, 64 new tokens, 2-core AVX2 EPYC): decode 1.01x (169.5 "
        "against 167.5 tok/s: the static graph has few such copies; the 30-layer multi-token figure above is with"
        " grouped-sdpa-without-repeat-kv), tokens equal",
        upstream="executorch==1.4.1 exir/passes/replace_aten_with_edge_pass.py (aten views become *_copy ops)",
        backends=("executorch",),
        models=("llama",),
        examples=(
            Match(
                lambda: _built(),
                "SDPA of 3 queries over an 8-slot cache read through a full slice, then another batch and size",
                other_inputs=lambda: _inputs(3, 1, 11, seed=1),
            ),
            Match(
                lambda: _built(scaled=False),
                "the same attention written as two 4-D matmuls",
                other_inputs=lambda: _inputs(1, 5, 6, seed=2),
            ),
            NoMatch(
                lambda: (_Flat(), _inputs()),
                "the same tensors flattened to 2-D matmuls",
                reason="no full slice and no batched matmul, so no same-shape copy to drop",
            ),
        ),
    ),
    count=count_identity_copies,
    edge_passes=_edge_passes,
)
