"""Grouped-query attention without `repeat_kv`: each key/value head attends once for its stacked query heads.

transformers' `repeat_kv` (`x[:, :, None].expand(b, kv, groups, s, d).reshape(b, kv * groups, s, d)`) and SDPA's
`enable_gqa` widen the keys and values to the query's head count before the attention: on a backend that runs
the widening as a copy, the whole cache is copied `groups` times over for keys and values, per layer and step.
The same attention reads each kv head once when the query's heads of one group are stacked along the query axis:
`(b, kv * groups, q, d) -> (b, kv, groups * q, d)` is a view of a contiguous query, every row keeps its own mask
row (the mask tiled `groups` times along the query axis when it varies by query), and the output is viewed back.
Each output row is the same softmax over the same scores, so the result is exact. The ExecuTorch and OpenVINO
rules (`*/grouped-sdpa-without-repeat-kv`) share the match, the rewrite and the examples here.
"""

from __future__ import annotations

import math
import operator
from typing import Any

import torch
from torch import fx

from hfexport.rewrites.examples import Built, Match, NoMatch
from hfexport.rewrites.kinds.fx import fill_missing_values
from hfexport.rewrites.rules._aten_graph import SDPA, is_full_slice, same_size, sdpa_argument

# Model types whose attention calls `repeat_kv` with fewer key/value heads in their usual configs (the rules match
# the graph pattern, not these names; the list is the rules' `models` metadata).
GQA_MODELS = ("llama", "mistral", "qwen2", "qwen3", "gemma", "smollm3", "olmo2", "granite")

_ops = torch.ops.aten
_RESHAPES = (_ops.reshape.default, _ops.view.default, _ops._unsafe_view.default)


def _value(node: Any) -> torch.Tensor | None:
    value = getattr(node, "meta", {}).get("val")
    return value if isinstance(value, torch.Tensor) else None


def _skip_full_slices(node: Any) -> Any:
    """The tensor under `x[:, :, ...]`-style slices that keep the whole axis (start 0, no end, step 1)."""
    while is_full_slice(node):
        node = node.args[0]
    return node


def _repeated_heads(node: Any) -> tuple[fx.Node, int] | None:
    """`(x, groups)` when `node` is `repeat_kv(x, groups)`: reshape(expand(unsqueeze(x, 2)), (b, kv * groups, s,
    d)) of a 4-D `x`, the expand widening only the new axis."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target not in _RESHAPES:
        return None
    expand = _skip_full_slices(node.args[0])
    if not isinstance(expand, fx.Node) or expand.target is not _ops.expand.default:
        return None
    unsqueeze = _skip_full_slices(expand.args[0])
    if not isinstance(unsqueeze, fx.Node) or unsqueeze.target is not _ops.unsqueeze.default:
        return None
    if not isinstance(unsqueeze.args[1], int) or unsqueeze.args[1] % 5 != 2:  # axis 2 (or -3) of the 5-D result
        return None
    source = unsqueeze.args[0]
    x, wide, out = _value(source), _value(expand), _value(node)
    if x is None or wide is None or out is None or x.dim() != 4 or wide.dim() != 5 or out.dim() != 4:
        return None
    groups = wide.shape[2]
    if not isinstance(groups, int) or groups < 2:
        return None
    same_axes = all(same_size(wide.shape[a], x.shape[b]) for a, b in ((0, 0), (1, 1), (3, 2), (4, 3)))
    merged = same_size(out.shape[1], x.shape[1] * groups)
    merged = merged and all(same_size(out.shape[a], x.shape[a]) for a in (0, 2, 3))
    return (source, groups) if same_axes and merged else None


def grouped_plan(node: fx.Node) -> tuple[fx.Node, fx.Node, int] | None:
    """`(key, value, groups)` of a grouped SDPA the rewrite keeps exact, else None."""
    if node.op != "call_function" or node.target is not SDPA:
        return None
    if sdpa_argument(node, "is_causal") or sdpa_argument(node, "dropout_p") not in (0, 0.0):
        return None  # causality over stacked query rows would mask by the wrong row index
    query = _value(node.args[0])
    if query is None or query.dim() != 4 or not isinstance(query.shape[1], int):
        return None
    key, value = node.args[1], node.args[2]
    if sdpa_argument(node, "enable_gqa"):
        k, v = _value(key), _value(value)
        if k is None or v is None or k.dim() != 4 or not isinstance(k.shape[1], int) or k.shape[1] < 1:
            return None
        if query.shape[1] % k.shape[1] or query.shape[1] == k.shape[1]:
            return None
        groups = query.shape[1] // k.shape[1]
    else:
        keys, values = _repeated_heads(key), _repeated_heads(value)
        if keys is None or values is None or keys[1] != values[1]:
            return None
        (key, groups), value = keys, values[0]
    heads = query.shape[1]
    if _value(key).shape[1] * groups != heads or _value(value).shape[1] * groups != heads:
        return None
    mask = sdpa_argument(node, "attn_mask")
    if mask is not None:
        m = _value(mask)
        if m is None or m.dim() > 4:
            return None
        shape = (1,) * (4 - m.dim()) + tuple(m.shape)
        if not (same_size(shape[1], 1) or same_size(shape[1], heads)):
            return None
        if not (same_size(shape[2], 1) or same_size(shape[2], query.shape[2])):
            return None
    return key, value, groups


def is_grouped_sdpa(node: fx.Node) -> bool:
    return grouped_plan(node) is not None


def grows_by_concatenation(node: fx.Node) -> bool:
    """Whether the keys of the grouped SDPA `node` are a `cat` (a cache that grows each step, DynamicCache's)."""
    plan = grouped_plan(node)
    key = _skip_full_slices(plan[0]) if plan is not None else None
    return isinstance(key, fx.Node) and key.op == "call_function" and key.target is _ops.cat.default


def _call(graph: fx.Graph, target: Any, *args: Any) -> fx.Node:
    return graph.call_function(target, args)


def _size(graph: fx.Graph, tensor: fx.Node, axis: int) -> fx.Node:
    """`tensor.shape[axis]` as a graph value (a SymInt on a dynamic axis), with its value for later shapes."""
    size = _call(graph, _ops.sym_size.int, tensor, axis)
    size.meta["val"] = _value(tensor).shape[axis]
    return size


def _times(graph: fx.Graph, size: fx.Node, factor: int) -> fx.Node:
    product = _call(graph, operator.mul, size, factor)
    product.meta["val"] = size.meta["val"] * factor
    return product


def _grouped_mask(graph: fx.Graph, mask: fx.Node, query: fx.Node, kv: int, groups: int) -> fx.Node:
    """The mask of the stacked query rows `(b, kv or 1, groups * q, s)`: row `r * q + t` of group `g` gets the
    mask row of head `g * groups + r`, query `t`."""
    m = _value(mask)
    for _ in range(4 - m.dim()):
        value = _value(mask)
        mask = _call(graph, _ops.unsqueeze.default, mask, 0)
        mask.meta["val"] = value.unsqueeze(0)  # a fake tensor's op runs in its own fake mode
    shape = (1,) * (4 - m.dim()) + tuple(m.shape)
    per_head = not same_size(shape[1], 1)
    per_query = not same_size(shape[2], 1)
    if not per_head and not per_query:
        return mask  # one row for every head and query: it broadcasts over the stacked rows as it is
    batch, rows, keys = (_size(graph, mask, axis) for axis in (0, 2, 3))
    queries = _size(graph, query, 2)
    heads = kv if per_head else 1
    # (b, heads, groups or 1, rows, s) -> every head of the group, every query row -> (b, heads, groups * q, s)
    split = _call(graph, _ops.reshape.default, mask, [batch, heads, groups if per_head else 1, rows, keys])
    wide = _call(graph, _ops.expand.default, split, [batch, heads, groups, queries, keys])
    return _call(graph, _ops.reshape.default, wide, [batch, heads, _times(graph, queries, groups), keys])


def stack_query_groups(gm: fx.GraphModule, node: fx.Node, *, query_takes_scale: bool, contiguous_output: bool) -> None:
    """Replace the grouped SDPA `node` (`grouped_plan`) by one over the stacked query heads and the unwidened keys
    and values.

    `query_takes_scale`: the query is multiplied by the whole scale and SDPA runs at scale 1 (for a backend that
    decomposes SDPA into `q * sqrt(scale)` and `k * sqrt(scale)`, where the keys' product runs over the cache).
    `contiguous_output`: a contiguous copy of the attention output before it is split back into heads (for a
    backend that re-decomposes SDPA with output strides under which that split is not a view).
    """
    key, value, groups = grouped_plan(node)
    query = node.args[0]
    heads = _value(query).shape[1]
    kv = heads // groups
    mask = sdpa_argument(node, "attn_mask")
    scale = sdpa_argument(node, "scale")
    graph = gm.graph
    before = set(graph.nodes)
    with graph.inserting_before(node):
        batch, length, dim = (_size(graph, query, axis) for axis in (0, 2, 3))
        stacked = _times(graph, length, groups)
        q = _call(graph, _ops.reshape.default, query, [batch, kv, stacked, dim])
        grouped_mask = None if mask is None else _grouped_mask(graph, mask, query, kv, groups)
        head = _value(query).shape[3]
        if query_takes_scale and scale is None and isinstance(head, int):
            scale = 1.0 / math.sqrt(head)  # SDPA's default
        if query_takes_scale and scale is not None:
            q = _call(graph, _ops.mul.Tensor, q, scale)
            scale = 1.0
        kwargs = {} if scale is None else {"scale": scale}
        attended = graph.call_function(SDPA, (q, key, value, grouped_mask, 0.0, False), kwargs)
        if contiguous_output:
            attended = graph.call_function(_ops.clone.default, (attended,), {"memory_format": torch.contiguous_format})
        out = _call(graph, _ops.reshape.default, attended, [batch, heads, length, dim])
    for new in graph.nodes:
        if new not in before:
            new.meta["stack_trace"] = node.meta.get("stack_trace")
            new.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
    node.replace_all_uses_with(out)
    graph.erase_node(node)
    fill_missing_values(gm)


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    # transformers' repeat_kv, as the models call it.
    batch, kv, length, dim = x.shape
    return x[:, :, None, :, :].expand(batch, kv, groups, length, dim).reshape(batch, kv * groups, length, dim)


class CachedGqaAttention(torch.nn.Module):
    """A Llama-style attention layer with 6 query heads on 2 key/value heads over a cache of earlier keys."""

    def __init__(
        self, mask_kind: str = "causal", gqa_flag: bool = False, causal: bool = False, grow: str = "cat"
    ) -> None:
        super().__init__()
        # grow: "cat" appends the new keys to the cache (DynamicCache); "write" writes them over its last
        # positions, a cache of fixed size (StaticCache's index_copy_). The mask then covers the last keys of `keep`.
        self.grow = grow
        torch.manual_seed(0)
        self.q = torch.nn.Linear(24, 24)
        self.kv = torch.nn.Linear(24, 16)
        self.mask_kind, self.gqa_flag, self.causal = mask_kind, gqa_flag, causal

    def forward(self, x: torch.Tensor, past: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        q = self.q(x).view(batch, length, 6, 4).transpose(1, 2)
        k, v = self.kv(x).view(batch, length, 2, 2, 4).permute(3, 0, 2, 1, 4).unbind(0)
        if self.grow == "cat":
            keys, values = torch.cat([past, k], dim=2), torch.cat([past.flip(-1), v], dim=2)
        else:
            at = torch.arange(past.shape[2] - length, past.shape[2])
            keys, values = past.index_copy(2, at, k), past.flip(-1).index_copy(2, at, v)
        total = keys.shape[2]
        keep = keep[:, keep.shape[1] - total :]
        mask = None
        if self.mask_kind == "causal":  # (b, 1, q, s) bool: padding of `keep` and causality after the cache
            rows = torch.arange(length)[:, None] + (total - length)
            mask = (torch.arange(total)[None, :] <= rows)[None, None] & keep[:, None, None, :].bool()
        elif self.mask_kind == "padding":  # (b, 1, 1, s) additive
            mask = torch.zeros(batch, 1, 1, total).masked_fill(keep[:, None, None, :] == 0, torch.finfo(x.dtype).min)
        elif self.mask_kind == "per-head":  # (b, heads, q, s) additive, a different bias per head
            bias = torch.arange(6, dtype=x.dtype)[:, None, None] * torch.arange(total, dtype=x.dtype) / total
            mask = bias.expand(batch, 6, length, total) - 1e4 * (keep[:, None, None, :] == 0)
        if self.gqa_flag:
            out = torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(
                q, _repeat_kv(keys, 3), _repeat_kv(values, 3), attn_mask=mask, is_causal=self.causal
            )
        return out.transpose(1, 2).reshape(batch, length, 24)


def gqa_inputs(batch: int, length: int, past: int, seed: int = 0, padded: int = 2) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    keep = torch.ones(batch, past + length, dtype=torch.long)
    keep[0, :padded] = 0  # left padding of the first row
    return {
        "x": torch.randn(batch, length, 24, generator=generator),
        "past": torch.randn(batch, 2, past, 4, generator=generator),
        "keep": keep,
    }


def gqa_built(mask_kind: str = "causal", gqa_flag: bool = False, causal: bool = False, grow: str = "cat") -> Built:
    return CachedGqaAttention(mask_kind, gqa_flag, causal, grow), gqa_inputs(2, 5, 7)


def grouped_examples(enable_gqa: bool = True, grow: str = "cat") -> tuple[Match | NoMatch, ...]:
    """The examples both backends' rules prove: masks of every form the match takes, fully masked rows, other
    batch/length/cache sizes, SDPA's own `enable_gqa` (where the backend converts it without the rule), and
    `is_causal` as the case left alone. `grow`: how the example's cache takes the new keys (`CachedGqaAttention`);
    "write" keeps every cache at least as long as the new keys."""
    write = grow == "write"
    gqa_flag = (
        Match(
            lambda: gqa_built("none", gqa_flag=True, grow=grow),
            "SDPA's own enable_gqa, no mask",
            other_inputs=lambda: gqa_inputs(1, 4, 6, seed=4),
        ),
    )
    return (
        Match(
            lambda: gqa_built("causal", grow=grow),
            "GQA (6 query heads on 2 kv heads) over a cache, a bool causal mask with a left-padded row, then "
            "another batch, length and cache",
            other_inputs=lambda: gqa_inputs(3, 1, 12, seed=1),
        ),
        Match(
            lambda: (CachedGqaAttention("causal", grow=grow), gqa_inputs(2, 3, 4, padded=6)),
            "the first row's padding covers its first queries' keys: fully masked rows, as eager has them",
            other_inputs=lambda: (
                gqa_inputs(2, 2, 6, seed=5, padded=7) if write else gqa_inputs(2, 4, 2, seed=5, padded=4)
            ),
            # OpenVINO's SDPA returns NaN for such rows with or without this rule; that rule zeroes them.
            needs=("openvino/sdpa-fully-masked-rows",),
        ),
        Match(
            lambda: gqa_built("padding", grow=grow),
            "an additive (b, 1, 1, s) padding mask, broadcast over every stacked row as it is",
            other_inputs=lambda: gqa_inputs(1, 2, 9, seed=2) if write else gqa_inputs(1, 9, 3, seed=2),
        ),
        Match(
            lambda: gqa_built("per-head", grow=grow),
            "an additive mask that differs per query head, split into groups",
            other_inputs=lambda: gqa_inputs(3, 2, 10, seed=3),
        ),
        *(gqa_flag if enable_gqa else ()),
        NoMatch(
            lambda: gqa_built("none", causal=True, grow=grow),
            "repeat_kv then is_causal=True",
            reason="causality is by query row index; stacked rows would be masked as later queries",
        ),
    )
