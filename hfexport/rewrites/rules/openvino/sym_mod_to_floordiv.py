"""Rule `openvino/sym-mod-to-floordiv` (shared code: `_symbolic`)."""

from __future__ import annotations

from hfexport.rewrites.example_models import dense_decoder
from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.fx import NodeRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules._symbolic import (
    ModOfSum,
    PadToMultiple,
    mod_to_floordiv,
    on_ints,
    operator,
    torch,
)

sym_mod_to_floordiv = NodeRule(
    RuleMeta(
        id="openvino/sym-mod-to-floordiv",
        why="openvino.convert_model has no translator for operator.mod on symbolic sizes ('No conversion rule "
        "found for operations: <built-in function mod>'), e.g. the Mamba-2 chunk padding (-L) % chunk_size of "
        "bamba; a % b is rewritten as a - (a // b) * b, equal for every int (Python's // floors)",
        upstream="openvino==2026.4.1 src/frontends/pytorch/src/op_table.cpp (FX translators for SymInt operators: add, "
        "sub, mul, floordiv, neg, getitem; none for mod; no issue filed found)",
        backends=("openvino",),
        # The rewrite floors a negative operand (a // b with a < 0): the CPU plugin truncates that Divide
        # unless exact-int-floor-divide makes it exact, and the sizes come out wrong.
        requires=("openvino/exact-int-floor-divide",),
        models=("bamba", "falcon_h1", "granitemoehybrid", "nemotron_h", "zamba"),
        examples=(
            Match(
                lambda: (PadToMultiple(), {"x": torch.randn(2, 7, 3)}),
                "(-L) % 4 pads a length of 7; then 9 and 12 (no padding)",
                other_inputs=lambda: {"x": torch.randn(3, 9, 3)},
            ),
            Match(
                lambda: (PadToMultiple(), {"x": torch.randn(2, 13, 3)}),
                "another sample length; then a multiple of 4",
                other_inputs=lambda: {"x": torch.randn(1, 12, 3)},
            ),
            Match(
                lambda: (ModOfSum(), {"x": torch.randn(2, 9), "y": torch.randn(5)}),
                "(L + 3) % B with a symbolic divisor",
                other_inputs=lambda: {"x": torch.randn(3, 11), "y": torch.randn(6)},
            ),
            NoMatch(dense_decoder, "a Llama forward (no modulo on sizes)"),
        ),
    ),
    predicate=lambda node: on_ints(node, (operator.mod,)),
    rewrite=mod_to_floordiv,
)
