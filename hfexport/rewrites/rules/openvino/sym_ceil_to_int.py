"""Rule `openvino/sym-ceil-to-int` (shared code: `_symbolic`)."""

from __future__ import annotations

from hfexport.rewrites.example_models import dense_decoder
from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.fx import NodeRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules._symbolic import (
    CAPACITY_EXAMPLES,
    BlocksOfLength,
    ceil_to_int,
    ceil_to_rewrite,
    torch,
)

sym_ceil_to_int = NodeRule(
    RuleMeta(
        id="openvino/sym-ceil-to-int",
        why="openvino.convert_model has no translator for math.ceil on symbolic sizes nor for torch.sym_float "
        "('No conversion rule found for operations: ceil, sym_float'): a dynamic export of NLLB-MoE (its expert "
        "capacity ceil(fraction * tokens)) or of a model that counts blocks as ceil(length / window) fails. The "
        "ceiling is rewritten in integers, -((-n * p) // q), equal to Python's float ceiling for every size "
        "below 2**53 / p; a fraction with a numerator above 2**21 is declined",
        upstream="openvino==2026.4.1 src/frontends/pytorch/src/op_table.cpp (FX translators for SymInt operators: "
        "add, sub, mul, floordiv, neg, getitem; none for ceil or sym_float; no issue filed found)",
        backends=("openvino",),
        # The rewrite floors a negative dividend, which the CPU plugin truncates unless made exact.
        requires=("openvino/exact-int-floor-divide",),
        models=("nllb-moe", "moshi", "big_bird", "longt5"),
        examples=(
            Match(
                lambda: (BlocksOfLength(), {"x": torch.randn(2, 7, 3)}),
                "ceil(L / 4) blocks for a length of 7; then 12 (a multiple) and batch 3",
                other_inputs=lambda: {"x": torch.randn(3, 12, 3)},
            ),
            Match(
                lambda: (BlocksOfLength(), {"x": torch.randn(2, 9, 3)}),
                "another sample length; then 1",
                other_inputs=lambda: {"x": torch.randn(2, 1, 3)},
            ),
            *CAPACITY_EXAMPLES,
            NoMatch(dense_decoder, "a Llama forward (no ceiling of sizes)"),
        ),
    ),
    predicate=ceil_to_rewrite,
    rewrite=ceil_to_int,
)
