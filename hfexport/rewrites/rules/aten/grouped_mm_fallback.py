"""Mixture-of-experts on ONNX: translate transformers' `grouped_mm_fallback` custom op into standard ONNX ops."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hfexport.rewrites.examples import Built, Match, NoMatch
from hfexport.rewrites.kinds.onnx import AtenOverride
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules._moe_batched import gpt_oss, qwen3_moe

_INT64 = 7  # onnx TensorProto.INT64


def _grouped_mm_translation() -> Callable[..., Any]:
    from onnxscript import opset18 as op

    def transformers_grouped_mm_fallback(input: Any, weight: Any, offs: Any) -> Any:
        # input (S, K) rows sorted by group, weight (G, K, N), offs (G,) cumulative group ends: rows
        # offs[i-1]:offs[i] are input @ weight[i]; rows past offs[-1] are zero (transformers' op zero-fills).
        groups = weight.shape[0] if weight.shape is not None else None
        if not isinstance(groups, int):
            raise NotImplementedError(f"grouped_mm_fallback needs a static number of groups (weight {weight.shape})")
        rows = op.Shape(input, start=0, end=1)
        # Ends past the row count end there, as the op's Python slices do; offs is non-decreasing by contract
        # (a cumsum of group sizes), so the slices below are the op's.
        bounds = op.Concat(op.Constant(value_ints=[0]), op.Min(op.Cast(offs, to=_INT64), rows), axis=0)
        # One row slice per group (an empty group gives a (0, K) slice) times its expert's weight: no gathered
        # (S, K, N) weight copy, and each group one MatMul, as the op's torch.mm is.
        products = [
            op.MatMul(
                op.Slice(input, op.Slice(bounds, [i], [i + 1]), op.Slice(bounds, [i + 1], [i + 2]), [0]),
                op.Gather(weight, op.Constant(value_int=i), axis=0),
            )
            for i in range(groups)
        ]
        # Rows past the last group are zero, as the op's zero-filled output leaves them.
        tail = op.Expand(
            op.CastLike(op.Constant(value_float=0.0), input),
            op.Concat(op.Sub(rows, op.Slice(bounds, [groups], [groups + 1])), op.Shape(weight, start=2, end=3), axis=0),
        )
        return op.Concat(*products, tail, axis=0)

    return transformers_grouped_mm_fallback


class _GroupedMm(torch.nn.Module):
    """The op itself, on group sizes given as an input: empty groups, rows past the last group, int64 offs."""

    def __init__(self, groups: int = 5, k: int = 8, n: int = 6) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(groups, k, n, generator=torch.Generator().manual_seed(0)))

    def forward(self, x: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
        from transformers.integrations import moe  # noqa: F401  (defines torch.ops.transformers.*)

        return torch.ops.transformers.grouped_mm_fallback(x, self.weight, torch.cumsum(sizes, 0))


def _rows(rows: int, sizes: list[int], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(rows, 8, generator=generator), "sizes": torch.tensor(sizes, dtype=torch.int64)}


def _moe_model(tokens: int, experts: int = 4, implementation: str | None = None) -> Built:
    # The tiny Qwen3-MoE the batched-experts patches use, without a cache (the experts are the point).
    model, inputs = qwen3_moe(tokens, experts, implementation)
    return model, {**inputs, "use_cache": False}


grouped_mm_fallback = AtenOverride(
    RuleMeta(
        id="aten/grouped-mm-fallback",
        why="transformers' grouped_mm experts (fp32/fp16 weights under torch.export) call the custom op "
        "`transformers::grouped_mm_fallback` (a Python loop over offs.tolist()); the ExportedProgram keeps it, "
        "as the seed documents, and torch.onnx has no translation for it ('No ONNX function found'). This "
        "translates it into Split / MatMul per expert / Concat, zeros for rows past the last group. ExecuTorch and "
        "OpenVINO run these experts routed per expert instead (patch/moe-batched-experts): their lowerings refuse "
        "the forward's aten.histc, not only this op",
        upstream="transformers==5.24.0 integrations/moe.py _grouped_mm_fallback (custom op used when "
        "_can_use_grouped_mm refuses non-bf16 weights under tracing; cf. https://github.com/pytorch/pytorch/issues/172440)",
        backends=("onnx",),
        models=("qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "olmoe", "granitemoehybrid"),
        examples=(
            Match(
                lambda: _moe_model(7),
                "qwen3_moe, odd token count, 4 experts; then batch 3 and a length past the sample",
                other_inputs=lambda: {"input_ids": torch.randint(0, 64, (3, 11)), "use_cache": False},
            ),
            Match(lambda: _moe_model(1, experts=8), "a single token: most experts get no rows"),
            Match(lambda: gpt_oss(5), "gpt_oss: transposed experts with biases"),
            Match(
                lambda: (_GroupedMm(), _rows(13, [0, 5, 0, 3, 4], seed=1)),
                "the op alone, int64 offs: empty groups, a row past the last group; then 29 rows, all assigned",
                other_inputs=lambda: _rows(29, [10, 0, 0, 7, 12], seed=2),
            ),
            NoMatch(
                lambda: _moe_model(5, implementation="batched_mm"),
                "qwen3_moe with batched_mm experts",
                reason="batched_mm experts never call grouped_mm: the program has no grouped_mm_fallback node",
            ),
        ),
    ),
    target="transformers.grouped_mm_fallback.default",
    translation=_grouped_mm_translation,
)
