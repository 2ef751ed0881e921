"""Grouped-query attention: the standard `Attention` op on the key/value heads themselves (no `repeat_kv`).

transformers' sdpa attention repeats the key/value heads itself (`repeat_kv`: unsqueeze, expand, reshape)
whenever it passes a mask, which every generation step does; torch.onnx translates that into
`Reshape(Expand(Unsqueeze(k, 2)))` before the `Attention` node: a copy of the whole key and value cache,
`num_heads / num_key_value_heads` times over, per layer and per step. The standard `Attention` op (opset
23) takes fewer key/value heads than query heads itself, query head h reading key/value head
`h // (q_heads / kv_heads)` — the order `repeat_kv` produces — so the repeat can go.

`check` requires the unsqueeze to add axis 2 and the expand to widen that axis only (the other four axes
keep the key's sizes, by shape inference), so the `Attention` node sees the same heads in the same order.
"""

from __future__ import annotations

from typing import Any

import torch


def _repeated(value: Any) -> Any:
    """`x` when `value` is `Reshape(Expand(Unsqueeze(x, [2]), ...), ...)` repeating the heads of a 4-D `x`
    (`[b, h, s, d]` -> `[b, h, n, s, d]` -> `[b, h * n, s, d]`), else None."""
    import onnx_ir as ir

    reshape = value.producer()
    if reshape is None or reshape.op_type != "Reshape":
        return None
    expand = reshape.inputs[0].producer()
    if expand is None or expand.op_type != "Expand":
        return None
    unsqueeze = expand.inputs[0].producer()
    if unsqueeze is None or unsqueeze.op_type != "Unsqueeze":
        return None
    axes = ir.convenience.get_const_tensor(unsqueeze.inputs[1])
    if axes is None or [int(a) for a in axes.numpy().reshape(-1)] not in ([2], [-3]):
        return None
    x = unsqueeze.inputs[0]
    widened, out = expand.outputs[0].shape, value.shape
    if x.shape is None or widened is None or out is None or x.shape.rank() != 4:
        return None
    if widened.rank() != 5 or out.rank() != 4:
        return None
    b, h, s, d = (x.shape[i] for i in range(4))
    n = widened[2]
    if not (isinstance(h, int) and isinstance(n, int)):
        return None
    if [widened[0], widened[1], widened[3], widened[4]] != [b, h, s, d]:
        return None
    if [out[0], out[1], out[2], out[3]] != [b, h * n, s, d]:
        return None
    return x


def gqa_rule() -> Any:
    from onnxscript.rewriter import pattern

    class AttentionWithoutRepeat(pattern.RewriteRuleClassBase):
        def pattern(self, op: Any, query: Any, key: Any, value: Any) -> Any:
            # key and value stay variables: the repeat is followed in `check` (its Unsqueeze/Expand/Reshape
            # stay for any other reader and go with the unused-node pass otherwise).
            return op.Attention(query, key, value, _allow_other_inputs=True, _outputs=["attention"])

        def check(self, context: Any, query: Any, key: Any, value: Any, **values: Any) -> Any:
            result = pattern.MatchResult()
            node = values["attention"].producer()
            if len(node.outputs) != 1:
                return result.fail("the Attention node returns its present key/value or scores too", node)
            if len(node.inputs) > 4:
                return result.fail("the Attention node takes a past key/value (heads counted there too)", node)
            keys, values_ = _repeated(key), _repeated(value)
            if keys is None or values_ is None:
                return result.fail("key and value are not both repeat_kv of 4-D tensors", key)
            if keys.shape[1] != values_.shape[1]:
                return result.fail("key and value have different head counts", value)
            if query.shape is None or query.shape.rank() != 4 or query.shape[1] != key.shape[1]:
                return result.fail("query is not 4-D with the repeated head count", query)
            return result

        def rewrite(self, op: Any, query: Any, key: Any, value: Any, **values: Any) -> Any:
            node = values["attention"].producer()
            return op.Attention(
                query,
                _repeated(key),
                _repeated(value),
                *node.inputs[3:],
                **{name: attr.value for name, attr in node.attributes.items()},
            )

    return AttentionWithoutRepeat.rule()


def _same_size(a: Any, b: Any) -> bool:
    """Two ONNX dimensions are provably equal: the same integer, or the same named symbol."""
    if isinstance(a, int) or isinstance(b, int):
        return a == b
    return isinstance(getattr(a, "value", None), str) and a == b


def attention_matmul_rule() -> Any:
    import math

    import numpy as np
    import onnx_ir as ir
    from onnxscript.rewriter import pattern

    class AttentionAsMatMul(pattern.RewriteRuleClassBase):
        def pattern(self, op: Any, query: Any, key: Any, value: Any) -> Any:
            return op.Attention(query, key, value, _allow_other_inputs=True, _outputs=["attention"])

        def check(self, context: Any, query: Any, key: Any, value: Any, **values: Any) -> Any:
            result = pattern.MatchResult()
            if context.model.opset_imports.get("", 0) < 25:
                return result.fail("below opset 25 ONNX Runtime runs Attention with its own kernel")
            node = values["attention"].producer()
            if len(node.outputs) != 1 or len(node.inputs) > 4:
                return result.fail("the Attention node has a past key/value or more outputs", node)
            for name, default in (("is_causal", 0), ("qk_matmul_output_mode", 0)):
                if node.attributes.get_int(name, default) != default:
                    return result.fail(f"{name} is set", node)
            if node.attributes.get_float("softcap", 0.0) != 0.0:
                return result.fail("softcap is set", node)
            for x in (query, key, value):
                if x.dtype != ir.DataType.FLOAT or x.shape is None or x.shape.rank() != 4:
                    return result.fail("query/key/value are not 4-D float32", x)
            heads, kv_heads = query.shape[1], key.shape[1]
            if not (isinstance(heads, int) and isinstance(kv_heads, int)) or heads % kv_heads:
                return result.fail("head counts are not static, or query heads are no multiple of kv heads", key)
            if value.shape[1] != kv_heads or not isinstance(value.shape[3], int):
                return result.fail("value heads differ from key heads, or its head size is not static", value)
            if not isinstance(query.shape[3], int) or query.shape[3] != key.shape[3]:
                return result.fail("query/key head sizes differ or are not static", query)
            mask = node.inputs[3] if len(node.inputs) > 3 else None
            if mask is not None:
                if mask.dtype != ir.DataType.BOOL or mask.shape is None:
                    return result.fail("the mask is not boolean (an additive float mask is left to Attention)", mask)
                if not (mask.shape.rank() == 2 or (mask.shape.rank() == 4 and mask.shape[1] == 1)):
                    return result.fail("the mask is not [q, kv] or [batch, 1, q, kv] (per-head masks)", mask)
            return result

        def rewrite(self, op: Any, query: Any, key: Any, value: Any, **values: Any) -> Any:
            node = values["attention"].producer()
            heads, kv_heads, size = query.shape[1], key.shape[1], query.shape[3]
            group = heads // kv_heads
            scale = node.attributes.get_float("scale", 1.0 / math.sqrt(size))

            def ints(*v: int) -> Any:
                return op.Constant(value=ir.tensor(np.array(v, dtype=np.int64)))

            def scalar(v: float) -> Any:
                return op.Constant(value=ir.tensor(np.array(v, dtype=np.float32)))

            # Query heads g * group + j share key/value head g: [b, heads, q, d] -> [b, kv_heads, group * q, d]
            # lines them up as rows j * q + s of one product per key/value head, with no copy of the cache.
            grouped = op.Reshape(op.Mul(query, scalar(scale)), ints(0, kv_heads, -1, size))
            scores = op.MatMul(grouped, op.Transpose(key, perm=[0, 1, 3, 2]))
            mask = node.inputs[3] if len(node.inputs) > 3 else None
            rows = None
            if mask is not None:
                rank = mask.shape.rank()
                # The lowest float, not -inf, so a fully masked row (left padding) gives no NaN; its output is
                # then zeroed, as Attention and torch's sdpa return zeros for such a row.
                lowest = float(np.finfo(np.float32).min)
                bias = op.Where(mask, scalar(0.0), scalar(lowest))
                rows = op.ReduceMax(op.Cast(mask, to=ir.DataType.FLOAT), ints(-1), keepdims=1)
                mask_rows = mask.shape[rank - 2]
                # Score row j * q + s is query s of group member j: a mask with one row for every query (a
                # key-padding mask, [b, 1, 1, kv] or [1, kv]) broadcasts over all group * q rows as it is; a mask
                # with q rows is tiled group times, after being widened to the query's q rows when its row count
                # may be a broadcast 1 (Tile of a 1-row mask would give group rows, not group * q).
                if group > 1 and mask_rows != 1:
                    if not _same_size(mask_rows, query.shape[2]):
                        ones = ints(*([1] * (rank - 2)))
                        widen = op.Concat(ones, op.Shape(query, start=2, end=3), ints(1), axis=0)
                        bias, rows = op.Expand(bias, widen), op.Expand(rows, widen)
                    repeat = ints(*([1] * (rank - 2)), group, 1)
                    bias, rows = op.Tile(bias, repeat), op.Tile(rows, repeat)
                scores = op.Add(scores, bias)
            out = op.MatMul(op.Softmax(scores, axis=-1), value)
            if rows is not None:
                out = op.Mul(out, rows)
            return op.Reshape(out, ints(0, heads, -1, value.shape[3]))

    return AttentionAsMatMul.rule()


# -- examples --------------------------------------------------------------------------------------


def _repeat_kv(x: torch.Tensor, n: int) -> torch.Tensor:
    b, h, s, d = x.shape
    return x[:, :, None, :, :].expand(b, h, n, s, d).reshape(b, h * n, s, d)


class _GroupedAttention(torch.nn.Module):
    """sdpa with repeat_kv and a boolean mask: 6 query heads over 2 key/value heads, as transformers does."""

    def __init__(self, repeat: bool = True) -> None:
        super().__init__()
        self.repeat = repeat

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        if self.repeat:
            k, v = _repeat_kv(k, 3), _repeat_kv(v, 3)
        else:  # heads tiled (h0 h1 h0 h1 ...), not repeat_kv's grouping: not what Attention's GQA reads
            k, v = k.repeat(1, 3, 1, 1), v.repeat(1, 3, 1, 1)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _inputs() -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    slots = torch.arange(10)
    rows = torch.arange(4) + 5
    mask = (slots[None, :] <= rows[:, None])[None, None].expand(2, 1, 4, 10).clone()
    mask[1, :, :, :2] = False  # a left-padded row
    return {
        "q": torch.randn(2, 6, 4, 8, generator=generator),
        "k": torch.randn(2, 2, 10, 8, generator=generator),
        "v": torch.randn(2, 2, 10, 8, generator=generator),
        "mask": mask,
    }


def grouped_example() -> Any:
    return _GroupedAttention(), _inputs()


def tiled_example() -> Any:
    return _GroupedAttention(repeat=False), _inputs()


def grouped_no_repeat() -> Any:
    return _GqaSdpa(), _inputs()


class _GqaSdpa(torch.nn.Module):
    """sdpa over fewer key/value heads (enable_gqa) with a boolean mask that fully masks one padded row."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        mask = mask.clone()
        mask[1, :, 0, :] = False  # a padding query: every slot masked
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


class _GqaSdpaMask(torch.nn.Module):
    """sdpa over fewer key/value heads (enable_gqa) with the mask as given (no row of it changed)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def key_padding() -> Any:
    """A [batch, 1, 1, kv] key-padding mask (one mask row for every query) over 4 query positions: batch 1
    left-padded, batch 2 fully masked (its output is zeros, as in torch's sdpa)."""
    generator = torch.Generator().manual_seed(2)
    mask = torch.ones(3, 1, 1, 10, dtype=torch.bool)
    mask[1, ..., :3] = False
    mask[2] = False
    return _GqaSdpaMask(), {
        "q": torch.randn(3, 6, 4, 8, generator=generator),
        "k": torch.randn(3, 2, 10, 8, generator=generator),
        "v": torch.randn(3, 2, 10, 8, generator=generator),
        "mask": mask,
    }


def broadcast_row_mask() -> Any:
    """A [1, kv] mask (one row for every query and batch) over 4 query positions."""
    generator = torch.Generator().manual_seed(3)
    mask = torch.ones(1, 10, dtype=torch.bool)
    mask[0, 7:] = False
    return _GqaSdpaMask(), {
        "q": torch.randn(2, 6, 4, 8, generator=generator),
        "k": torch.randn(2, 2, 10, 8, generator=generator),
        "v": torch.randn(2, 2, 10, 8, generator=generator),
        "mask": mask,
    }


_SYMBOLIC_MASK_ROWS = """
<ir_version: 11, opset_import: ["" : 25]>
agraph (float[2, 6, Q, 8] q, float[2, 2, 10, 8] k, float[2, 2, 10, 8] v, bool[2, 1, M, 10] mask)
    => (float[2, 6, Q, 8] out) {
    out = Attention(q, k, v, mask)
}
"""


def symbolic_mask_rows() -> Any:
    """Attention-25 whose mask rows `M` are a symbol other than the query's `Q`: fed one row (a broadcast)."""
    import numpy as np

    generator = np.random.default_rng(4)
    mask = np.ones((2, 1, 1, 10), dtype=bool)
    mask[1, ..., :3] = False
    return _SYMBOLIC_MASK_ROWS, {
        "q": generator.standard_normal((2, 6, 4, 8)).astype(np.float32),
        "k": generator.standard_normal((2, 2, 10, 8)).astype(np.float32),
        "v": generator.standard_normal((2, 2, 10, 8)).astype(np.float32),
        "mask": mask,
    }
