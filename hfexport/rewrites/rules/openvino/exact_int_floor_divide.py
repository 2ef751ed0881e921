"""Rule `openvino/exact-int-floor-divide` (shared code: `_symbolic`)."""

from __future__ import annotations

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.openvino import OpenVINOModelRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules._symbolic import (
    FloatDivide,
    IntFloorDivide,
    ShortenByCeil,
    exact_floor_divides,
    signed_ints,
    torch,
)

exact_int_floor_divide = OpenVINOModelRule(
    RuleMeta(
        id="openvino/exact-int-floor-divide",
        why="the CPU plugin truncates an integer Divide with m_pythondiv=true toward zero (-7 // 4 gives -1, not "
        "-2); the PyTorch frontend translates // on sizes and integer floor_divide to that Divide, and torch's "
        "symbolic shapes write ceil divisions as -((-L) // n), so padded lengths and chunk counts come out "
        "wrong whenever L is not a multiple (bamba's Mamba-2 chunks). Each such Divide becomes "
        "(a - FloorMod(a, b)) / b, an exact division",
        upstream="https://github.com/openvinotoolkit/openvino/issues/38248 (fix proposed in "
        "https://github.com/openvinotoolkit/openvino/pull/38260)",
        backends=("openvino",),
        models=("bamba", "falcon_h1", "granitemoehybrid", "nemotron_h", "zamba"),
        examples=(
            Match(
                lambda: (ShortenByCeil(), {"x": torch.randn(2, 7)}),
                "L + (-L) // 4 on a size; then another length",
                other_inputs=lambda: {"x": torch.randn(3, 13)},
            ),
            Match(
                lambda: (IntFloorDivide(), signed_ints(0, 16)),
                "integer floor_divide with operands of both signs",
                other_inputs=lambda: signed_ints(1, 33),
            ),
            NoMatch(
                lambda: (FloatDivide(), {"x": torch.randn(2, 3), "y": torch.randn(2, 3)}),
                "float division and floor_divide",
            ),
        ),
    ),
    transform=exact_floor_divides,
)
