"""Rule `onnx/skip-layer-norm-fusion` (shared code: `_fusions_skip_norm`)."""

from __future__ import annotations

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.onnx import OnnxRewriteRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.onnx._fusions_skip_norm import (
    ln_broadcast,
    ln_layer,
    ln_layer_2d,
    ln_layer_fp16,
    ln_two_axes,
    skip_layer_norm_rule,
)

skip_layer_norm_fusion = OnnxRewriteRule(
    meta=RuleMeta(
        id="onnx/skip-layer-norm-fusion",
        why="residual Add + LayerNormalization in one SkipLayerNormalization kernel; the body is onnxscript 0.7.2's "
        "own ORT fusion (ort_fusions.skip_normalization: tiny-gpt2 4 fused, ORT vs eager 1.2e-07, as hfexport's "
        "pattern gave), float32 only, plus hfexport's pattern for 2-D [tokens, hidden] sums, which it lacks"
        "; measured by tools/ab_rules.py (8 layers at SmolLM2-135M's width, batch 1, 128-token "
        "prompt, 64 new tokens, ONNX Runtime 1.32 CPU, 2-core AVX2 EPYC): decode 0.98x on GPT-2 (156.5 against "
        "159.0 tok/s): no gain beyond the A/B's spread on this CPU",
        upstream="onnxruntime==1.32.0 contrib op com.microsoft.SkipLayerNormalization",
        backends=("onnx",),
        models=("bert", "roberta", "gpt2", "phi"),
        kind="optimization",
        examples=(
            Match(ln_layer, "pre-norm layer, LayerNorm, [2, 5, 24], the sum reused", atol=1e-5),
            Match(ln_layer_2d, "pre-norm layer, LayerNorm, 2-D [7, 17] (hfexport's own pattern)", atol=1e-5),
            NoMatch(ln_layer_fp16, "float16: onnxscript's fusion would take it, the float32 guard does not"),
            NoMatch(ln_broadcast, "the addends broadcast ([2, 5, 24] + [24])"),
            NoMatch(ln_two_axes, "LayerNorm over the last two axes"),
        ),
    ),
    rewrite_rule=skip_layer_norm_rule,
)
