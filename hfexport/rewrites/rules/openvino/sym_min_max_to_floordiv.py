"""Rule `openvino/sym-min-max-to-floordiv` (shared code: `_symbolic`)."""

from __future__ import annotations

from hfexport.rewrites.example_models import dense_decoder
from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.fx import NodeRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules._symbolic import (
    MinMaxOfSizes,
    TopKOfAtMost,
    min_max_to_floordiv,
    on_ints,
    torch,
)

# The floor divisions written here are exact in OpenVINO only with exact-int-floor-divide (alone, the converted
# model computes them in float: wrong sizes at run time), as in every OpenVINO export.
_NEEDS = ("openvino/exact-int-floor-divide",)

sym_min_max_to_floordiv = NodeRule(
    RuleMeta(
        id="openvino/sym-min-max-to-floordiv",
        why="openvino.convert_model has no translator for torch.sym_min / torch.sym_max on symbolic sizes "
        "('No conversion rule found for operations: <function sym_min>'), e.g. axk2's indexer topk(k=min(top_k, "
        "L)); min(a, b) = b + d * -(d // (d*d + 1)) with d = a - b (max: a - ...), equal for every int",
        upstream="openvino==2026.4.1 src/frontends/pytorch/src/op_table.cpp (FX translators for SymInt operators: add, "
        "sub, mul, floordiv, neg, getitem; none for sym_min/sym_max; torch.onnx had the same gap: "
        "https://github.com/pytorch/pytorch/pull/152196)",
        backends=("openvino",),
        # The rewrite floors a negative operand (a // b with a < 0): the CPU plugin truncates that Divide
        # unless exact-int-floor-divide makes it exact, and the sizes come out wrong.
        requires=("openvino/exact-int-floor-divide",),
        models=("axk2",),
        examples=(
            Match(
                lambda: (TopKOfAtMost(), {"x": torch.randn(2, 3)}),
                "min(4, L) with L = 3 < 4; then L = 9 > 4",
                other_inputs=lambda: {"x": torch.randn(3, 9)},
                needs=_NEEDS,
            ),
            Match(
                lambda: (MinMaxOfSizes(), {"x": torch.randn(5, 2), "y": torch.randn(3, 2)}),
                "min and max of two sizes, first larger; then second larger",
                other_inputs=lambda: {"x": torch.randn(2, 2), "y": torch.randn(6, 2)},
                needs=_NEEDS,
            ),
            NoMatch(
                lambda: (TopKOfAtMost(), {"x": torch.randn(2, 9)}),
                "static shapes: min(4, 9) is folded",
                reason="no symbolic min or max is left in a static program",
            ),
            NoMatch(dense_decoder, "a Llama forward"),
        ),
    ),
    predicate=lambda node: on_ints(node, (torch.sym_min, torch.sym_max)),
    rewrite=min_max_to_floordiv,
)
