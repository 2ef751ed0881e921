"""Rule `aten/is-all-true` (shared code: `_checks`)."""

from __future__ import annotations

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.onnx import AtenOverride
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.aten._checks import (
    Unchecked,
    checked,
    checked_odd,
    is_all_true_translation,
    selects_false,
    selects_true,
)

is_all_true = AtenOverride(
    RuleMeta(
        id="aten/is-all-true",
        why="transformers' torch_compilable_check calls torch._check_tensor_all while tracing (LLaVA checks "
        "that the image features fill the image tokens), which leaves aten._is_all_true in the graph; "
        "torch.onnx (2.13, onnxscript 0.7.2) has no translation for it and the export fails "
        "('No ONNX function found for aten._is_all_true')",
        upstream="onnxscript==0.7.2 function_libs/torch_lib/ops/core.py has no aten::_is_all_true",
        backends=("onnx",),
        models=("llava",),
        examples=(
            Match(checked, "a tensor check before the output; then other, odd sizes", other_inputs=checked_odd),
            Match(
                selects_true,
                "the check's value selects the output: true; then other sizes where it is false",
                other_inputs=selects_false,
            ),
            NoMatch(lambda: (Unchecked(), checked()[1]), "the same computation without a check"),
        ),
    ),
    target="aten._is_all_true.default",
    translation=is_all_true_translation,
)
