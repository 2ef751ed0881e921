"""`torch.histc` with min == max (the range taken from the data) as ONNX; other ranges keep onnxscript's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.onnx import AtenOverride
from hfexport.rewrites.rule import RuleMeta


def _data_range(self: Any, bins: int = 100, min: float = 0.0, max: float = 0.0) -> bool:
    return min == max


def _histc_translation() -> Callable[..., Any]:
    from onnxscript import opset18 as op
    from onnxscript.function_libs.torch_lib.ops.core import aten_histc

    fixed_range = getattr(aten_histc, "function", aten_histc)

    def aten_histc_data_range(self: Any, bins: int = 100, min: float = 0.0, max: float = 0.0) -> Any:
        if not _data_range(self, bins, min, max):
            return fixed_range(self, bins, min, max)
        # torch (ATen/native/Histogram.cpp, histc): min == max takes the data's min and max; equal ones widen
        # by 1 each way. A histogram of no elements is all zeros (the bounds never matter then). The data range
        # holds every element, so nothing falls outside (a NaN makes torch raise: its range is not finite).
        flat = op.Reshape(self, [-1])
        one = op.CastLike(1.0, flat)
        low = op.ReduceMin(flat, keepdims=0)
        high = op.ReduceMax(flat, keepdims=0)
        same = op.Equal(low, high)
        low = op.Where(same, op.Sub(low, one), low)
        high = op.Where(same, op.Add(high, one), high)
        # ATen/native/cpu/HistogramKernel.cpp: pos = (elt - left) * bins / (right - left), truncated; the last
        # edge belongs to the last bin.
        position = op.Div(op.Mul(op.Sub(flat, low), op.CastLike(float(bins), flat)), op.Sub(high, low))
        index = op.Cast(op.Floor(position), to=7)  # INT64
        index = op.Where(op.Equal(index, op.Constant(value_int=bins)), op.Constant(value_int=bins - 1), index)
        inside = op.And(op.GreaterOrEqual(flat, low), op.LessOrEqual(flat, high))
        index = op.Where(inside, index, op.Constant(value_int=-1))
        hits = op.Equal(op.Unsqueeze(index, [1]), op.Unsqueeze(op.Range(0, bins, 1), [0]))
        counts = op.ReduceSum(op.Cast(hits, to=7), [0], keepdims=0)
        return op.CastLike(counts, flat)

    return aten_histc_data_range


class _ExpertCounts(torch.nn.Module):
    """transformers' grouped_mm experts: tokens per expert as `histc(ids, bins=E, min=0, max=E - 1)`; with one
    expert min == max == 0."""

    def __init__(self, experts: int = 1) -> None:
        super().__init__()
        self.experts = experts

    def forward(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        sorted_ids, _ = torch.sort(ids.reshape(-1))
        counts = torch.histc(sorted_ids.float(), bins=self.experts, min=0, max=self.experts - 1)
        offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
        return hidden * offsets[-1].to(hidden.dtype)


class _Histogram(torch.nn.Module):
    def __init__(self, bins: int, low: float = 0.0, high: float = 0.0) -> None:
        super().__init__()
        self.bins, self.low, self.high = bins, low, high

    def forward(self, values: torch.Tensor) -> torch.Tensor:
        return torch.histc(values * 1.5, bins=self.bins, min=self.low, max=self.high)


def _routing(tokens: int = 5, top_k: int = 2) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(tokens)
    return {"hidden": torch.randn(tokens, 8, generator=generator), "ids": torch.zeros(tokens, top_k, dtype=torch.long)}


def _spread(count: int = 13, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random values with repeats, the exact minimum and maximum (the last edge) among them."""
    values = torch.randn(count, generator=torch.Generator().manual_seed(seed))
    values = torch.cat([values, values[:3], values.min()[None], values.max()[None]])
    return {"values": values.reshape(1, -1)}


histc_data_range = AtenOverride(
    RuleMeta(
        id="aten/histc-data-range",
        why="transformers' grouped_mm experts (integrations/moe.py) count tokens per expert with "
        "`torch.histc(ids, bins=E, min=0, max=E - 1)`; with one expert min == max, where torch takes the range "
        "from the data, and onnxscript's aten_histc raises ('aten_histc with min == max (0) is not supported', "
        "encoder/hunyuan_v1_moe). The override computes the data range in the graph (widened by 1 when the data "
        "are all equal, as torch does) and bins as torch's CPU kernel does; other ranges keep onnxscript's",
        upstream="onnxscript==0.7.2 function_libs/torch_lib/ops/core.py aten_histc (static bin edges only)",
        backends=("onnx",),
        models=("hunyuan_v1_moe",),
        examples=(
            Match(
                lambda: (_ExpertCounts(), _routing()),
                "one expert: bins=1, min == max == 0, all ids equal; then more tokens",
                other_inputs=lambda: _routing(tokens=9),
            ),
            Match(
                lambda: (_Histogram(bins=4), _spread()),
                "4 bins over the data's range: repeats, the exact min and max; then other values",
                other_inputs=lambda: _spread(count=30, seed=3),
            ),
            Match(lambda: (_Histogram(bins=3, low=2.0, high=2.0), _spread(count=7, seed=5)), "min == max == 2"),
            NoMatch(
                lambda: (_Histogram(bins=5, low=-1.0, high=1.0), _spread()),
                "a fixed range [-1, 1] (values outside it too): onnxscript's translation",
            ),
        ),
    ),
    target="aten.histc.default",
    translation=_histc_translation,
    counts=_data_range,
)
