"""Rule `executorch/quant-computed-weight-linear-untagged` (shared code: `_quant_weight_decompression`)."""

from __future__ import annotations

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.fx import NodeRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.executorch._quant_weight_decompression import (
    TransposedLinear,
    inputs,
    is_computed_weight_linear,
    untag_linear,
)

quant_computed_weight_linear_untagged = NodeRule(
    RuleMeta(
        id="executorch/quant-computed-weight-linear-untagged",
        why="a linear on a weight computed in the graph (NNCF's int8/int4 weight decompression) over a "
        "non-contiguous 3-D input decomposes to expand + bmm, and XNNPACK's ConvertToLinearPass, seeing the bmm "
        "tagged as an nn.Linear, rebuilds a linear on the 3-D expanded weight: 't() expects a tensor with <= 2 "
        "dimensions'; on a contiguous or 2-D input (view + addmm) the rebuilt linear ignores the computed weight and "
        "the outputs are off by ~2000 (values ~11). The linear loses its source-module tag (numerics unchanged), "
        "so the bmm runs as a bmm and the addmm as the portable kernel",
        upstream="executorch==1.4.1 backends/xnnpack/_passes/convert_to_linear.py (create_linear takes the bmm's "
        "expanded operands for the linear's input and weight)",
        backends=("executorch",),
        models=("nncf-weight-compression",),
        examples=(
            Match(
                lambda: (TransposedLinear(), inputs(5, 2)),
                "int8 weights decompressed in an nn.Linear, transposed [5, 2, 24] input; then [9, 3, 24]",
                atol=1e-4,
                other_inputs=lambda: inputs(9, 3, seed=2),
            ),
            Match(
                lambda: (TransposedLinear(rows=True), inputs(7)),
                "int8 weights on a 2-D input (addmm, wrong values without the rule); then 16 rows",
                atol=1e-4,
                other_inputs=lambda: inputs(16, seed=3),
            ),
            Match(
                lambda: (TransposedLinear(rows=True), inputs(5, 3)),
                "int8 weights on a contiguous 3-D input, as every projection but o_proj; then [2, 9, 24]",
                atol=1e-4,
                other_inputs=lambda: inputs(2, 9, seed=4),
            ),
            NoMatch(
                lambda: (TransposedLinear(compressed=False), inputs(5, 2)),
                "the same linear on its own parameter: XNNPACK delegates it",
            ),
        ),
    ),
    predicate=is_computed_weight_linear,
    rewrite=untag_linear,
)
