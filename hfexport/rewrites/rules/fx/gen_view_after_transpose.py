"""A reshape of a transposed sdpa output whose mask comes from a parameter gets an explicit contiguous copy.

T5's attention merges its heads as `sdpa(...)` -> `transpose(1, 2)` -> `reshape(batch, length, -1)` (the
`.contiguous()` in between is not recorded: at trace time the fused CPU kernel's output, laid out
`[batch, length, heads, dim]`, is already contiguous once transposed). torch.onnx re-traces the program in
`run_decompositions` with grad mode on, where T5's position bias — computed from the
`relative_attention_bias` embedding, a parameter — requires grad; CPU sdpa does not take the fused kernel
for a mask that requires grad and falls back to its math form, whose output is an ordinary
`[batch, heads, length, dim]`. The merge reshape, decomposed against the first layout into a view, then
fails: "Cannot view a tensor with shape [2, 8, 4, 8] and strides (256, 8, 64, 1) as a tensor with shape
(2, 8, 32)".

The rule puts `aten.clone(memory_format=torch.contiguous_format)` between such a `transpose`/`permute` of an
sdpa output (through reshapes) and the `view`/`reshape` of it, only when the sdpa's mask is a float tensor
computed from a parameter. A boolean mask (Llama, Mistral, GPT-2, ... and T5's cross-attention, whose float
mask comes from the inputs alone) keeps the fused kernel on re-trace: nothing changes layout and those
models export without the copy, so they are not matched. A clone has the same values whatever the strides,
so the result is exact; ONNX has no strides (the clone is an Identity that the optimiser drops).

`executorch/sdpa-output-contiguous-before-view` is the ExecuTorch counterpart for a different trigger:
`to_edge` always decomposes sdpa into its math form, which breaks only the ops traced as `aten.view`
(GPT-2's Conv1D `x.view(-1, hidden)`), whatever the mask; a `reshape` is re-decomposed there with the new
strides and needs nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from hfexport.rewrites.example_models import dense_decoder
from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.fx import NodeRule
from hfexport.rewrites.rule import RuleMeta

aten = torch.ops.aten
_STRIDE_CHANGING = (aten.transpose.int, aten.permute.default)
_RESHAPES = (aten.view.default, aten.reshape.default)
# Only the composite op picks its kernel again when re-traced; a fused kernel recorded as such keeps its layout.
_SDPA = aten.scaled_dot_product_attention.default


def _sdpa_source(node: Any) -> fx.Node | None:
    """The sdpa node `node` is the output of, possibly through reshapes, else None."""
    while isinstance(node, fx.Node) and node.op == "call_function":
        if node.target is _SDPA:
            return node
        if node.target not in _RESHAPES:
            return None
        node = node.args[0]
    return None


def _requires_grad(node: fx.Node) -> bool:
    """A placeholder or attribute holding a tensor that requires grad (a parameter of the exported program)."""
    if node.op == "placeholder":
        value = node.meta.get("val")
    elif node.op == "get_attr":
        value = getattr(node.graph.owning_module, str(node.target), None)
    else:
        return False
    return isinstance(value, torch.Tensor) and value.requires_grad


def _mask_from_parameter(sdpa: fx.Node) -> bool:
    """Whether the sdpa's mask is a float tensor computed from a parameter: it requires grad when torch.onnx
    re-traces, and CPU sdpa then takes its math form instead of the fused kernel the trace recorded."""
    mask = sdpa.args[3] if len(sdpa.args) > 3 else sdpa.kwargs.get("attn_mask")
    value = mask.meta.get("val") if isinstance(mask, fx.Node) else None
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return False
    seen, stack = set(), [mask]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if _requires_grad(node):
            return True
        stack.extend(node.all_input_nodes)
    return False


def _view_of_transpose(node: fx.Node) -> bool:
    if node.op != "call_function" or node.target not in _RESHAPES:
        return False
    source = node.args[0]
    if not (isinstance(source, fx.Node) and source.op == "call_function" and source.target in _STRIDE_CHANGING):
        return False
    sdpa = _sdpa_source(source.args[0])
    return sdpa is not None and _mask_from_parameter(sdpa)


def _copy_before_view(gm: fx.GraphModule, node: fx.Node) -> None:
    source = node.args[0]
    with gm.graph.inserting_before(node):
        copy = gm.graph.call_function(aten.clone.default, (source,), {"memory_format": torch.contiguous_format})
    if "val" in source.meta:
        copy.meta["val"] = source.meta["val"].clone(memory_format=torch.contiguous_format)
    node.args = (copy, *node.args[1:])
    gm.graph.lint()
    gm.recompile()


class _AttentionMerge(torch.nn.Module):
    """T5-style: sdpa with a relative position bias from an embedding (a parameter), transpose back to
    [batch, length, heads, dim], merge the heads with `reshape`."""

    def __init__(self, heads: int = 4, distance: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.distance = distance
        self.relative = torch.nn.Embedding(2 * distance + 1, heads)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(k.shape[2])[None, :] - torch.arange(q.shape[2])[:, None]
        bias = self.relative(offsets.clamp(-self.distance, self.distance) + self.distance)  # [q, kv, heads]
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias.permute(2, 0, 1)[None])
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1) * 2


class _InputMaskMerge(torch.nn.Module):
    """The same merge with a float mask given as an input (T5's cross-attention): it never requires grad."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1) * 2


class _TransposeMerge(torch.nn.Module):
    """The same merge of a tensor that is not an attention output: its layout does not change under
    decomposition, so it is left alone."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return (q + v).transpose(1, 2).reshape(q.shape[0], q.shape[2], -1) * 2


class _ContiguousMerge(torch.nn.Module):
    """A reshape of a contiguous tensor: recorded as a plain view of it, not of a transpose."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * 2).reshape(x.shape[0], -1)


def _qkv(batch: int = 2, length: int = 5) -> dict[str, Any]:
    """Query, key and value as attention computes them: projections `[b, l, h, d]` transposed to `[b, h, l, d]`."""
    generator = torch.Generator().manual_seed(0)
    return {name: torch.randn(batch, length, 4, 8, generator=generator).transpose(1, 2) for name in ("q", "k", "v")}


def _qkv_mask(batch: int = 2, length: int = 5) -> dict[str, Any]:
    mask = torch.zeros(batch, 1, length, length)
    mask[-1, ..., :2] = torch.finfo(torch.float32).min  # a left-padded sequence
    return {**_qkv(batch, length), "mask": mask}


gen_view_after_transpose = NodeRule(
    meta=RuleMeta(
        id="fx/gen-view-after-transpose",
        why="an sdpa output's transpose is contiguous at trace time (the fused CPU kernel's memory order), so "
        "`.contiguous()` is not recorded; torch.onnx re-traces with grad on, where a float mask computed from a "
        "parameter (T5's position bias) requires grad, CPU sdpa falls back to its math form laid out [b, h, l, d], "
        "and the merge reshape, decomposed as a view, fails: 'Cannot view a tensor with shape [...] and strides "
        "[...]' (T5's self-attention). Only such masks are matched: Llama's boolean mask keeps the fused kernel "
        "(tiny-llama exports to ONNX without the copy, max abs diff 8.9e-08)",
        upstream="https://github.com/pytorch/pytorch/issues/141107 (a view of the sdpa output's transpose fails once "
        "run_decompositions lays the math output out differently; also pytorch/pytorch#136543)",
        backends=("onnx",),
        models=("t5", "mt5", "longt5"),
        examples=(
            Match(
                lambda: (_AttentionMerge(), _qkv()),
                "sdpa with a position bias from a parameter, transpose, merge heads",
                other_inputs=lambda: _qkv(3, 9),
            ),
            NoMatch(dense_decoder, "Llama attention: a boolean mask, the fused kernel's layout on re-trace too"),
            NoMatch(lambda: (_InputMaskMerge(), _qkv_mask()), "a float mask from the inputs (T5's cross-attention)"),
            NoMatch(lambda: (_TransposeMerge(), _qkv()), "a transpose of a sum, merged: not an attention output"),
            NoMatch(lambda: (_ContiguousMerge(), {"x": torch.randn(2, 3, 4)}), "a view of a contiguous tensor"),
        ),
    ),
    predicate=_view_of_transpose,
    rewrite=_copy_before_view,
)
