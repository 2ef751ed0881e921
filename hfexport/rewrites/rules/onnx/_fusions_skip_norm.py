"""Residual add + normalisation -> ONNX Runtime `Skip(Simplified)LayerNormalization` (CPU fusions).

Every pre-norm decoder layer and every post-norm encoder layer adds a residual and normalises the sum:
`norm(a + b)`, with `a + b` also kept as the next residual. ONNX Runtime's contrib ops
`SkipSimplifiedLayerNormalization` (RMSNorm) and `SkipLayerNormalization` (LayerNorm) do both in one
kernel and return the sum as their fourth output, which replaces the Add for its other consumers.

Both rules run after `onnx/rms-norm-fusion`, which produced the `SimplifiedLayerNormalization` nodes. Their
body is onnxscript 0.7.2's own ORT fusion (`onnxscript.rewriter.ort_fusions.skip_normalization`, which also
takes a bias added before or after the residual), on the same terms as before: measured on tiny-llama (4
SkipSimplifiedLayerNormalization) and tiny-gpt2 (4 SkipLayerNormalization), the same nodes and the same ORT
error as hfexport's own pattern. Two things that fusion lacks are kept here:
- float32 only: it fuses float16 too, where the kernel accumulates differently from the unfused graph;
- 2-D activations (`[tokens, hidden]`): it requires `[batch, seq, hidden]`, so hfexport's own pattern
  fuses the rank-2 sums, with the same conditions (same shapes, no broadcast; last-axis normalisation in
  float32 with a 1-D scale and bias).
"""

from __future__ import annotations

from typing import Any

import torch

_MS = "com.microsoft"


def _float32_only(fusion: type) -> type:
    """onnxscript's fusion class `fusion`, refusing what is not float32 (the kernel's float16 accumulation
    differs from the unfused graph's)."""
    import onnx_ir as ir

    class Float32(fusion):
        def check(self, context: Any, **values: Any) -> Any:
            result = super().check(context, **values)
            if result and any(values[name].dtype != ir.DataType.FLOAT for name in ("input", "skip")):
                return result.fail("not float32", values["input"])
            return result

    return Float32


def _fail_add(result: Any, a: Any, b: Any) -> Any:
    """Why `a + b` cannot be the 2-D input + skip of the kernel (None when it can); onnxscript's fusion has 3-D."""
    import onnx_ir as ir

    if a.dtype != ir.DataType.FLOAT or b.dtype != ir.DataType.FLOAT:
        return result.fail("not float32", a)
    if a.shape is None or b.shape is None or a.shape.rank() != 2:
        return result.fail("input rank unknown or not 2 (onnxscript's fusion takes rank 3)", a)
    if a.shape != b.shape:
        return result.fail(f"addends of shapes {a.shape} and {b.shape}: the fused kernel does not broadcast", b)
    if not isinstance(a.shape[-1], int):
        return result.fail("hidden size not static", a)
    return None


def _fail_norm(result: Any, x: Any, axis: Any, stash_type: Any, *vectors: Any) -> Any:
    """Why the norm of `x` with these attributes and scale/bias vectors cannot be fused (None when it can)."""
    rank = x.shape.rank()
    axis_value = axis.as_int() if axis is not None else -1
    if axis_value not in (-1, rank - 1):
        return result.fail("normalisation not over the last axis only", x)
    if stash_type is not None and stash_type.as_int() != 1:
        return result.fail("normalisation not computed in float32", x)
    for vector in vectors:
        if vector is None:
            continue
        if vector.shape is None or vector.shape.rank() != 1 or vector.shape[0] != x.shape[-1]:
            return result.fail("scale/bias is not a 1-D vector over the hidden axis", vector)
    return None


def skip_rms_rule() -> Any:
    from onnxscript.rewriter import pattern

    class SkipRmsNorm(pattern.RewriteRuleClassBase):
        def pattern(self, op: Any, a: Any, b: Any, scale: Any) -> Any:
            total = op.Add(a, b)
            normed = op.SimplifiedLayerNormalization(total, scale, _allow_other_attributes=True, _outputs=["normed"])
            return normed, total

        def check(self, context: Any, a: Any, b: Any, scale: Any, normed: Any, **_: Any) -> Any:
            result = pattern.MatchResult()
            node = normed.producer()
            failed = _fail_add(result, a, b) or _fail_norm(
                result, a, node.attributes.get("axis"), node.attributes.get("stash_type"), scale
            )
            return failed if failed is not None else result

        def rewrite(self, op: Any, a: Any, b: Any, scale: Any, normed: Any, **_: Any) -> Any:
            epsilon = normed.producer().attributes.get_float("epsilon", 1e-5)
            out, _mean, _inv_std, total = op.SkipSimplifiedLayerNormalization(
                a, b, scale, epsilon=epsilon, _domain=_MS, _outputs=4
            )
            return out, total

    from onnxscript.rewriter.ort_fusions.skip_normalization import SkipRmsNormFusion

    upstream = _float32_only(SkipRmsNormFusion)
    return pattern.RewriteRuleSet(
        [
            upstream.rule("SkipRmsNormPreBias", has_bias=True, bias_pre_add=True),
            upstream.rule("SkipRmsNormBias", has_bias=True, bias_pre_add=False),
            upstream.rule("SkipRmsNorm", has_bias=False),
            SkipRmsNorm.rule(),
        ]
    )


def skip_layer_norm_rule() -> Any:
    from onnxscript.rewriter import pattern

    class SkipLayerNorm(pattern.RewriteRuleClassBase):
        def pattern(self, op: Any, a: Any, b: Any, scale: Any, bias: Any) -> Any:
            total = op.Add(a, b)
            normed = op.LayerNormalization(total, scale, bias, _allow_other_attributes=True, _outputs=["normed"])
            return normed, total

        def check(self, context: Any, a: Any, b: Any, scale: Any, bias: Any, normed: Any, **_: Any) -> Any:
            result = pattern.MatchResult()
            node = normed.producer()
            failed = _fail_add(result, a, b) or _fail_norm(
                result, a, node.attributes.get("axis"), node.attributes.get("stash_type"), scale, bias
            )
            return failed if failed is not None else result

        def rewrite(self, op: Any, a: Any, b: Any, scale: Any, bias: Any, normed: Any, **_: Any) -> Any:
            epsilon = normed.producer().attributes.get_float("epsilon", 1e-5)
            out, _mean, _inv_std, total = op.SkipLayerNormalization(
                a, b, scale, bias, epsilon=epsilon, _domain=_MS, _outputs=4
            )
            return out, total

    from onnxscript.rewriter.ort_fusions.skip_normalization import SkipLayerNormFusion

    upstream = _float32_only(SkipLayerNormFusion)
    return pattern.RewriteRuleSet(
        [
            upstream.rule("SkipLayerNormPreBias", has_bias=True, bias_pre_add=True),
            upstream.rule("SkipLayerNormBias", has_bias=True, bias_pre_add=False),
            upstream.rule("SkipLayerNorm", has_bias=False),
            SkipLayerNorm.rule(),
        ]
    )


# -- examples --------------------------------------------------------------------------------------


class _RmsNorm(torch.nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(hidden, generator=torch.Generator().manual_seed(0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class _PreNormLayer(torch.nn.Module):
    """A decoder layer's residual stream: h = x + f(norm(x)); out = norm(h); the sum h is used twice."""

    def __init__(self, hidden: int, layer_norm: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm1 = torch.nn.LayerNorm(hidden) if layer_norm else _RmsNorm(hidden)
        self.norm2 = torch.nn.LayerNorm(hidden) if layer_norm else _RmsNorm(hidden)
        self.proj = torch.nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.proj(self.norm1(x))
        return self.norm2(h) + h


class _BroadcastSkip(torch.nn.Module):
    """norm(x + bias_row): the addends broadcast (a learned [hidden] offset), which the kernel cannot."""

    def __init__(self, hidden: int, layer_norm: bool) -> None:
        super().__init__()
        self.offset = torch.nn.Parameter(torch.randn(hidden, generator=torch.Generator().manual_seed(2)))
        self.norm = torch.nn.LayerNorm(hidden) if layer_norm else _RmsNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.offset)


def _x(*shape: int, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    return {"x": torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(dtype)}


def rms_layer() -> Any:
    return _PreNormLayer(24, layer_norm=False), _x(2, 5, 24)


def rms_layer_2d() -> Any:
    return _PreNormLayer(17, layer_norm=False), _x(7, 17)


def rms_broadcast() -> Any:
    return _BroadcastSkip(24, layer_norm=False), _x(2, 5, 24)


def ln_layer() -> Any:
    return _PreNormLayer(24, layer_norm=True), _x(2, 5, 24)


def ln_layer_2d() -> Any:
    return _PreNormLayer(17, layer_norm=True), _x(7, 17)


def ln_layer_fp16() -> Any:
    return _PreNormLayer(24, layer_norm=True).half(), _x(2, 5, 24, dtype=torch.float16)


def ln_broadcast() -> Any:
    return _BroadcastSkip(24, layer_norm=True), _x(2, 5, 24)


class _NormOverSequence(torch.nn.Module):
    """LayerNorm over the last two axes: not the kernel's last-axis normalisation."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm((5, 24))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.norm(x + y)


def ln_two_axes() -> Any:
    inputs = _x(2, 5, 24)
    return _NormOverSequence(), {**inputs, "y": inputs["x"].flip(0)}
