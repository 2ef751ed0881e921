"""Rule `onnx/skip-rms-norm-fusion` (shared code: `_fusions_skip_norm`)."""

from __future__ import annotations

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.onnx import OnnxRewriteRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.onnx._fusions_skip_norm import rms_broadcast, rms_layer, rms_layer_2d, skip_rms_rule

skip_rms_norm_fusion = OnnxRewriteRule(
    meta=RuleMeta(
        id="onnx/skip-rms-norm-fusion",
        why="residual Add + SimplifiedLayerNormalization in one SkipSimplifiedLayerNormalization kernel; the body "
        "is onnxscript 0.7.2's own ORT fusion (ort_fusions.skip_normalization: tiny-llama 4 fused, ORT vs eager "
        "8.9e-08, as hfexport's pattern gave), float32 only, plus hfexport's pattern for 2-D [tokens, hidden] "
        "sums, which it lacks"
        "; measured by tools/ab_rules.py (8 layers at SmolLM2-135M's width, batch 1, 128-token "
        "prompt, 64 new tokens, ONNX Runtime 1.32 CPU, 2-core AVX2 EPYC): decode 0.97x on the Llama (125.8 "
        "against 129.1 tok/s): no gain beyond the A/B's spread on this CPU",
        upstream="onnxruntime==1.32.0 contrib op com.microsoft.SkipSimplifiedLayerNormalization",
        backends=("onnx",),
        models=("llama", "mistral", "qwen2", "qwen3", "gemma"),
        kind="optimization",
        requires=("onnx/rms-norm-fusion",),
        examples=(
            Match(rms_layer, "pre-norm layer, RMSNorm, [2, 5, 24], the sum reused", atol=1e-5),
            Match(rms_layer_2d, "pre-norm layer, RMSNorm, 2-D [7, 17] (hfexport's own pattern)", atol=1e-5),
            NoMatch(rms_broadcast, "the addends broadcast ([2, 5, 24] + [24])"),
        ),
    ),
    rewrite_rule=skip_rms_rule,
)
