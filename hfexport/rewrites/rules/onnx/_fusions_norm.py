"""RMSNorm -> ONNX Runtime `SimplifiedLayerNormalization` (CPU fusions, stage `onnx`).

torch.onnx translates `x * rsqrt(mean(x**2, -1, keepdim=True) + eps) * weight` (LlamaRMSNorm and its many
copies) into Pow / ReduceMean / Add / Sqrt / Reciprocal / Mul / Mul. ONNX Runtime has one kernel for it,
`SimplifiedLayerNormalization`, a contrib op that ORT registers in the *default* ONNX domain (opset 1),
so the fused node carries domain "" and works at every opset we export (the standard `RMSNormalization`
exists only from opset 23).

Two rules, in this order:
- `onnx/rms-norm-fusion`: the whole norm, weight included, is onnxscript's own ORT fusion
  (`onnxscript.rewriter.ort_fusions.rms_normalization`: either operand order of the weight multiply, the
  float16 upcast form with its casts). It gives the same nodes as the pattern hfexport had (tiny-llama: 5
  norms, the same ORT error 8.9e-08) and the same float16 error as fusing the normalisation alone.
- `onnx/rms-norm-core-fusion`: hfexport's own pattern for what that fusion lacks, a normalisation with no
  weight multiply after it: `SimplifiedLayerNormalization(x, ones)`.
"""

from __future__ import annotations

from typing import Any

import torch

# ONNX TensorProto data types the normalisation may be computed in (stash_type of the fused node).
_FLOAT, _DOUBLE = 1, 11


def _rms_pattern(op: Any, x: Any, exponent: Any, axes: Any, epsilon: Any) -> Any:
    """`x * (1 / sqrt(mean(x**2, axes) + eps))` as torch.onnx emits it (`check` requires axes == [-1])."""
    # The exponent is a variable, read in `check`: a literal 2.0 here would make the matcher annotate the
    # Constant nodes it inspects, changing graphs it then leaves alone.
    mean_square = op.ReduceMean(op.Pow(x, exponent), axes, keepdims=1, noop_with_empty_axes=0)
    return op.Mul(x, op.Reciprocal(op.Sqrt(op.Add(mean_square, epsilon))))


def _epsilon(value: Any) -> float | None:
    """The scalar float `value` holds (an initializer or a Constant node output), else None."""
    import onnx_ir as ir

    tensor = ir.convenience.get_const_tensor(value)
    if tensor is None or tensor.size != 1 or tensor.dtype not in (ir.DataType.FLOAT, ir.DataType.DOUBLE):
        return None
    return float(tensor.numpy().reshape(()))


def _const_ints(value: Any) -> list[int] | None:
    """The integers `value` holds: a constant, or a Reshape of constants (what translation leaves before the
    optimizer folds it; fusions run after the optimizer, but also without it and in the rule examples)."""
    import onnx_ir as ir

    tensor = ir.convenience.get_const_tensor(value)
    if tensor is None and value.producer() is not None and value.producer().op_type == "Reshape":
        tensor = ir.convenience.get_const_tensor(value.producer().inputs[0])
    if tensor is None or tensor.dtype not in (ir.DataType.INT64, ir.DataType.INT32):
        return None
    return [int(v) for v in tensor.numpy().reshape(-1)]


def _fail_x(result: Any, x: Any, exponent: Any, axes: Any, epsilon: Any) -> Any:
    """Why the matched norm of `x` cannot become the fused node (None when it can)."""
    import onnx_ir as ir

    if x.dtype not in (ir.DataType.FLOAT, ir.DataType.DOUBLE):
        return result.fail(f"normalisation in {x.dtype}, the fused node computes in float32/float64", x)
    rank = x.shape.rank() if x.shape is not None else None
    if rank is None or rank < 1:
        return result.fail("input rank unknown", x)
    if _const_ints(axes) not in ([-1], [rank - 1]):
        return result.fail("the mean is not over the last axis only", axes)
    if _epsilon(epsilon) is None:
        return result.fail("epsilon is not a constant float scalar", epsilon)
    if _epsilon(exponent) != 2.0:
        return result.fail("not a square", exponent)
    return None


def rms_norm_rule() -> Any:
    """onnxscript's ORT fusion of the whole RMSNorm (both weight-multiply orders, optional upcast casts)."""
    from onnxscript.rewriter.ort_fusions.rms_normalization import rms_normalization_ruleset

    return rms_normalization_ruleset


def rms_norm_core_rule() -> Any:
    import numpy as np
    import onnx_ir as ir
    from onnxscript.rewriter import pattern

    class RmsNormCore(pattern.RewriteRuleClassBase):
        def pattern(self, op: Any, x: Any, exponent: Any, axes: Any, epsilon: Any) -> Any:
            return _rms_pattern(op, x, exponent, axes, epsilon)

        def check(self, context: Any, x: Any, exponent: Any, axes: Any, epsilon: Any, **_: Any) -> Any:
            result = pattern.MatchResult()
            failed = _fail_x(result, x, exponent, axes, epsilon)
            if failed is not None:
                return failed
            if not isinstance(x.shape[-1], int):
                return result.fail("the normalised axis has no static size (needed for the unit scale)", x)
            return result

        def rewrite(self, op: Any, x: Any, epsilon: Any, **_: Any) -> Any:
            double = x.dtype == ir.DataType.DOUBLE
            ones = ir.tensor(np.ones(x.shape[-1], dtype=np.float64 if double else np.float32))
            return op.SimplifiedLayerNormalization(
                x,
                op.Constant(value=ones),
                axis=-1,
                epsilon=_epsilon(epsilon),
                stash_type=_DOUBLE if double else _FLOAT,
                _outputs=1,
            )

    return RmsNormCore.rule()


# -- examples --------------------------------------------------------------------------------------


class _RmsNorm(torch.nn.Module):
    """LlamaRMSNorm's arithmetic: upcast to float32, normalise, cast back, then scale."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype = torch.float32, weight_first: bool = True):
        super().__init__()
        generator = torch.Generator().manual_seed(0)
        self.weight = torch.nn.Parameter((1 + 0.1 * torch.randn(hidden, generator=generator)).to(dtype))
        self.eps, self.weight_first = eps, weight_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = h.to(dtype)
        return self.weight * h if self.weight_first else h * self.weight


class _Block(torch.nn.Module):
    """Linear -> RMSNorm -> Linear, so the norm sits between other ops as in a decoder layer."""

    def __init__(self, hidden: int, eps: float, **kwargs: Any):
        super().__init__()
        torch.manual_seed(0)
        self.up, self.norm = torch.nn.Linear(hidden, hidden), _RmsNorm(hidden, eps, **kwargs)
        self.down = torch.nn.Linear(hidden, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.norm(self.up(x)))


class _Unscaled(torch.nn.Module):
    """An RMS normalisation with no weight multiply (the sum with the input follows), optionally upcast."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return h.to(x.dtype) + x


class _MeanOverSequence(torch.nn.Module):
    """An RMS over the sequence axis (dim 1), not the hidden one: not a SimplifiedLayerNormalization."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(1, keepdim=True) + 1e-6)


def _x(*shape: int, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    return {"x": torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(dtype)}


def block() -> Any:
    return _Block(37, 1e-6), _x(2, 5, 37)


def rms_fp16() -> Any:
    return _RmsNorm(37, 1e-5, dtype=torch.float16), _x(2, 5, 37, dtype=torch.float16)


def rms_weight_last() -> Any:
    return _RmsNorm(33, 1e-5, weight_first=False), _x(3, 33)


def unscaled() -> Any:
    return _Unscaled(1e-6), _x(2, 5, 37)


def unscaled_fp16() -> Any:
    return _Unscaled(1e-5), _x(2, 5, 37, dtype=torch.float16)


# NoMatch graphs are ONNX text: the rewriter annotates the Constant nodes of any graph it runs on, so a
# raw torch export would read as "changed" even when nothing matched (the value_info `<float e, ...>`
# declares up front the types that annotation adds).
_RMS_TEXT = """
<ir_version: 10, opset_import: ["" : 18]>
g (float[2,5,8] x, float[8] w) => (float[2,5,8] y) <float e, int64[1] axes, float eps> {{
  h = Identity(x)
  e = Constant <value = float {{{exponent}}}> ()
  sq = Pow(h, e)
  axes = Constant <value = int64[1] {{{axis}}}> ()
  ms = ReduceMean <keepdims = 1> (sq, axes)
  eps = Constant <value = float {{1e-6}}> ()
  s = Add(ms, eps)
  r = Sqrt(s)
  inv = Reciprocal(r)
  n = Mul(h, inv)
  y = Mul(w, n)
}}
"""


def _rms_text(axis: int = -1, exponent: float = 2.0) -> Any:
    return _RMS_TEXT.format(axis=axis, exponent=exponent), {}


def mean_over_sequence() -> Any:
    return _rms_text(axis=1)


def cube() -> Any:
    return _rms_text(exponent=3.0)
