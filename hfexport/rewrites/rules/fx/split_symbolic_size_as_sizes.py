"""A split or chunk with a symbolic piece size becomes `aten.split_with_sizes` with the sizes written out.

ProphetNet's n-gram self-attention concatenates its main stream and `ngram` predict streams along the sequence axis
and cuts them apart again with `hidden_states.chunk(1 + ngram, dim=1)` (and `.chunk(1 + ngram, dim=2)` on the
projected queries, keys and values). With a dynamic sequence axis torch.export records `aten.chunk(x, n, dim)` on an
axis of symbolic length D, which torch.onnx's decomposition turns into `aten.split.Tensor(x, s, dim)` with `s =
ceil(D / n)` a SymInt (a split by a size computed from a shape, `x.split(x.shape[0] // 2)`, is recorded as that
directly). torchlib translates it as `SplitToSequence(x, s)` with `s` a 0-d int64 tensor of unknown value. The
onnxscript optimizer then crashes in its constant folding of SplitToSequence: the split's shape is static (0-d) but
not 1-D and it has no value, so it reaches `split_value.ndim` on None ("'NoneType' object has no attribute 'ndim'").

The number of pieces is fixed in the exported graph (the node's `val` is a list of that many tensors, which the
graph reads by index), so the rule writes the sizes out: `split_with_sizes(x, [s] * (n - 1) + [D - (n - 1) * s],
dim)` with `D = sym_size(x, dim)` (for a chunk, `s = (D + n - 1) // n` as torch computes it). That is torch.split's
own definition (every piece `s` long, the last one the remainder), so the pieces are the same slices for every input
the program accepts (an uneven last piece included). torch.onnx translates it as `SplitToSequence` over a 1-D sizes
tensor of static length n, which the optimizer folds into one `Split` with n outputs. Only a symbolic split size is
matched: an int split size translates to a constant the optimizer handles (or leaves alone, on a dynamic axis).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch import fx

from hfexport.rewrites.example_models import dense_decoder
from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.fx import NodeRule
from hfexport.rewrites.rule import RuleMeta

aten = torch.ops.aten


def _val(value: Any) -> Any:
    return value.meta.get("val") if isinstance(value, fx.Node) else None


def _split_operands(node: fx.Node) -> tuple[fx.Node, Any, int, int] | None:
    """`(x, size, dim, pieces)` of a split with a symbolic piece size: `aten.split.Tensor(x, s, dim)` with `s` a
    SymInt node (size is that node), or `aten.chunk(x, chunks, dim)` on an axis of symbolic length (size is the
    int `-chunks`: the piece size ceil(D / chunks) is built by the rewrite)."""
    if node.op != "call_function" or node.target not in (aten.split.Tensor, aten.chunk.default) or node.kwargs:
        return None
    if len(node.args) < 2:
        return None
    x, size = node.args[0], node.args[1]
    dim = node.args[2] if len(node.args) > 2 else 0
    source, pieces = _val(x), _val(node)
    if not isinstance(source, torch.Tensor) or not isinstance(dim, int) or not -source.dim() <= dim < source.dim():
        return None
    if not isinstance(pieces, (list, tuple)) or not pieces:
        return None
    dim %= source.dim()
    if node.target is aten.chunk.default:
        # torch.onnx decomposes chunk into split.Tensor(x, ceil(D / chunks)): symbolic when D is.
        if not isinstance(size, int) or size <= 0 or not isinstance(source.shape[dim], torch.SymInt):
            return None
        return x, -size, dim, len(pieces)
    if not isinstance(size, fx.Node) or not isinstance(_val(size), torch.SymInt):
        return None  # a Python int: torch.onnx writes a constant split, which the optimizer handles
    return x, size, dim, len(pieces)


def _is_symbolic_split(node: fx.Node) -> bool:
    return _split_operands(node) is not None


def _sym(graph: fx.Graph, target: Any, args: tuple[Any, ...], val: Any) -> fx.Node:
    created = graph.call_function(target, args)
    created.meta["val"] = val
    return created


def _as_split_with_sizes(gm: fx.GraphModule, node: fx.Node) -> None:
    x, size, dim, pieces = _split_operands(node)  # type: ignore[misc]
    graph = gm.graph
    length = _val(x).shape[dim]
    with graph.inserting_before(node):
        total = _sym(graph, aten.sym_size.int, (x, dim), length)
        if isinstance(size, int):
            # chunk: torch's piece size is ceil(D / chunks) (aten/native/TensorShape.cpp chunk).
            chunks = -size
            padded = _sym(graph, operator.add, (total, chunks - 1), length + chunks - 1)
            size = _sym(graph, operator.floordiv, (padded, chunks), (length + chunks - 1) // chunks)
        step = _val(size)
        if pieces == 1:
            last = total
        else:
            taken = _sym(graph, operator.mul, (size, pieces - 1), step * (pieces - 1))
            last = _sym(graph, operator.sub, (total, taken), length - step * (pieces - 1))
        sizes = [size] * (pieces - 1) + [last]
        replacement = graph.call_function(aten.split_with_sizes.default, (x, sizes, dim))
    replacement.meta.update(node.meta)
    node.replace_all_uses_with(replacement)
    graph.erase_node(node)


class _Streams(torch.nn.Module):
    """ProphetNet-style: `1 + ngram` streams concatenated on the sequence axis and chunked apart again."""

    def __init__(self, streams: int = 3, dim: int = 1) -> None:
        super().__init__()
        self.streams, self.dim = streams, dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        joined = torch.cat([x * (i + 1) - i for i in range(self.streams)], dim=self.dim)
        main, *predict = joined.chunk(self.streams, dim=self.dim)
        return torch.cat([main, *(p.softmax(-1) for p in predict)], dim=-1)


class _Remainder(torch.nn.Module):
    """`torch.split` by a size computed from the length: two pieces, the last one shorter (uneven)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        head, tail = torch.split(x, x.shape[1] // 2 + 1, dim=1)
        return head.sum(1) * 2 + tail.sum(1) + tail.shape[1]


class _BatchHalves(torch.nn.Module):
    """ZoeDepth-style: two stages stacked on the batch axis, split back by the batch size."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        stacked = torch.cat([x, x.flip(1) * 3], dim=0)
        first, second = stacked.split(x.shape[0], dim=0)
        return first - second.cumsum(1)


class _HiddenChunk(torch.nn.Module):
    """A gate chunked on a static hidden axis (GLU style): an int split size."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        value, gate = self.proj(x).chunk(2, dim=-1)
        return value * torch.sigmoid(gate)


def _x(batch: int = 2, length: int = 5, width: int = 4, seed: int = 0, dtype: torch.dtype = torch.float32) -> Any:
    generator = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(batch, length, width, generator=generator).to(dtype)}


split_symbolic_size_as_sizes = NodeRule(
    RuleMeta(
        id="fx/split-symbolic-size-as-sizes",
        why="torch.onnx translates aten.split.Tensor with a symbolic split size (also what its decomposition makes of "
        "aten.chunk on a dynamic axis: x.chunk(n, dim) in "
        "ProphetNet's n-gram streams, seq2seq/ and causal_lm/prophetnet; ZoeDepth's hidden_states.split(batch_size) "
        "with a dynamic batch) as SplitToSequence(x, s) with s a 0-d "
        "tensor of unknown value, and the onnxscript optimizer's constant folding of it crashes ('NoneType' object "
        "has no attribute 'ndim', stage optimize). The split is written as split_with_sizes([s, ..., s, D - (n-1)s]) "
        "with the graph's own piece count n: the same slices, folded by the optimizer into one Split",
        upstream="onnxscript==0.7.2 optimizer/_constant_folding.py split_to_sequence (a static 0-d split without a "
        "value reaches split_value.ndim; the branch on the split's shape came with "
        "https://github.com/microsoft/onnxscript/pull/2544)",
        backends=("onnx",),
        models=("prophetnet", "zoedepth"),
        examples=(
            Match(
                lambda: (_Streams(), _x()),
                "three streams of 5 tokens chunked apart on the sequence axis; then 13 tokens and batch 3",
                other_inputs=lambda: _x(batch=3, length=13, seed=1),
            ),
            Match(
                lambda: (_Streams(streams=2, dim=2), _x(length=3, width=7, seed=2)),
                "two streams on an odd last axis (width 7); then width 1 and 6 tokens",
                other_inputs=lambda: _x(batch=2, length=6, width=1, seed=3),
            ),
            Match(
                lambda: (_Remainder(), _x(length=7, seed=4)),
                "split by L // 2 + 1 at 7 tokens: pieces of 4 and 3; then 10 tokens (6 and 4)",
                other_inputs=lambda: _x(batch=1, length=10, seed=5),
            ),
            Match(
                lambda: (_BatchHalves(), _x(batch=2, length=3, seed=9)),
                "two stages stacked on the batch axis and split by the batch size; then batch 5",
                other_inputs=lambda: _x(batch=5, length=4, seed=10),
            ),
            Match(
                lambda: (_Streams(), _x(length=4, seed=6, dtype=torch.float16)),
                "float16 streams; then 9 tokens",
                other_inputs=lambda: _x(length=9, seed=7, dtype=torch.float16),
                atol=1e-3,
                rtol=1e-3,
            ),
            NoMatch(
                lambda: (_Streams(), _x()),
                "the same streams exported with static shapes",
                reason="the split size is the int 5",
            ),
            NoMatch(
                lambda: (_HiddenChunk(), _x(length=6, seed=8)),
                "a gate chunked on the static hidden axis",
                reason="the split size is the int 4",
            ),
            NoMatch(dense_decoder, "a Llama forward (no symbolic split)"),
        ),
    ),
    predicate=_is_symbolic_split,
    rewrite=_as_split_with_sizes,
)
