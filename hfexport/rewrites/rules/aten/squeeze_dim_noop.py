"""Rule `aten/squeeze-dim-noop` (shared code: `_checks`)."""

from __future__ import annotations

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.onnx import AtenOverride
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.aten._checks import (
    SqueezeAll,
    SqueezeBatch,
    SqueezeTokens,
    squeeze_dim_translation,
    squeeze_is_noop,
    torch,
)

squeeze_dim_noop = AtenOverride(
    RuleMeta(
        id="aten/squeeze-dim-noop",
        why="torch.squeeze(x, dim) leaves a dimension whose size is not 1 unchanged; torchlib translates it to ONNX "
        "Squeeze(axes=[dim]) regardless, which ONNX Runtime rejects when that size is not 1 ('Dimension of input 0 "
        "must be 1 instead of 8'; Mistral3's image features, squeezed on the token axis). A symbolic size is a "
        "no-op too: torch decides squeeze while tracing and keeps an axis it has not specialised to 1, so a dynamic "
        "token count must not become Squeeze either. Hits count only those no-op squeezes; a squeeze of a size-1 "
        "axis keeps torchlib's Squeeze",
        upstream="onnxscript==0.7.2 function_libs/torch_lib/ops/core.py aten_squeeze_dim: Squeeze without checking the "
        "size",
        backends=("onnx",),
        models=("mistral3", "lighton_ocr"),
        examples=(
            Match(lambda: (SqueezeTokens(), {"features": torch.randn(1, 7, 5)}), "squeeze(0) of [7, 5]: a no-op"),
            Match(
                lambda: (SqueezeTokens(), {"features": torch.randn(1, 7, 5)}),
                "squeeze(0) of [tokens, 5] with a dynamic token count (the size is a symbol, not an int)",
                other_inputs=lambda: {"features": torch.randn(1, 4, 3)},
            ),
            NoMatch(lambda: (SqueezeAll(), {"features": torch.randn(1, 3)}), "squeeze() of every size-1 axis"),
            NoMatch(lambda: (SqueezeBatch(), {"features": torch.randn(1, 3)}), "squeeze(0) of a size-1 axis"),
        ),
    ),
    target="aten.squeeze.dim",
    translation=squeeze_dim_translation,
    counts=squeeze_is_noop,
)
