"""Rule `onnx/rms-norm-fusion` (shared code: `_fusions_norm`)."""

from __future__ import annotations

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.onnx import OnnxRewriteRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.onnx._fusions_norm import (
    block,
    cube,
    mean_over_sequence,
    rms_fp16,
    rms_norm_rule,
    rms_weight_last,
)

rms_norm_fusion = OnnxRewriteRule(
    meta=RuleMeta(
        id="onnx/rms-norm-fusion",
        why="one SimplifiedLayerNormalization kernel instead of seven ops per RMSNorm on ONNX Runtime; the body is "
        "onnxscript 0.7.2's own ORT fusion (ort_fusions.rms_normalization), which gives the nodes hfexport's "
        "pattern gave (tiny-llama: 5 norms fused, ORT vs eager 8.9e-08 either way) and also takes the float16 "
        "upcast form with its weight (float16 error equal to fusing the normalisation alone)"
        "; measured by tools/ab_rules.py (8 layers at SmolLM2-135M's width, batch 1, 128-token "
        "prompt, 64 new tokens, ONNX Runtime 1.32 CPU, 2-core AVX2 EPYC): decode 1.04x on the Llama (125.8 "
        "against 120.9 tok/s), tokens equal",
        upstream="onnxruntime==1.32.0 contrib op SimplifiedLayerNormalization",
        backends=("onnx",),
        models=("llama", "mistral", "qwen2", "qwen3"),
        kind="optimization",
        examples=(
            Match(block, "Linear -> RMSNorm (hidden 37, eps 1e-6) -> Linear, float32", atol=1e-5),
            # ORT's float32 rsqrt may differ from torch's in the last bit: one float16 ulp (2e-3 below 4).
            Match(rms_fp16, "float16 input, float32 normalisation, float16 weight (hidden 37)", atol=2e-3),
            Match(rms_weight_last, "norm(x) * weight, hidden 33", atol=1e-5),
            NoMatch(mean_over_sequence, "mean over the sequence axis"),
            NoMatch(cube, "mean of cubes"),
        ),
    ),
    rewrite_rule=rms_norm_rule,
)
