"""Rule `onnx/rms-norm-core-fusion` (shared code: `_fusions_norm`)."""

from __future__ import annotations

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.onnx import OnnxRewriteRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.onnx._fusions_norm import (
    block,
    cube,
    mean_over_sequence,
    rms_norm_core_rule,
    unscaled,
    unscaled_fp16,
)

rms_norm_core_fusion = OnnxRewriteRule(
    meta=RuleMeta(
        id="onnx/rms-norm-core-fusion",
        why="fuses an RMS normalisation with no weight multiply after it, which onnxscript 0.7.2's ORT fusion "
        "(the body of onnx/rms-norm-fusion) does not match; it runs after that rule and takes only what it "
        "left (0 norms on tiny-llama and tiny-gpt2)"
        "; measured by tools/ab_rules.py (8 layers at SmolLM2-135M's width, batch 1, 128-token "
        "prompt, 64 new tokens, ONNX Runtime 1.32 CPU, 2-core AVX2 EPYC): it fires on nanochat (34 norms at 8 "
        "layers, weightless RMSNorms; also llama4's and deepseek_v4's in the sweeps), decode 0.99x (149.0 against"
        " 150.7 tok/s): no gain beyond the A/B's spread on this CPU",
        upstream="onnxruntime==1.32.0 contrib op SimplifiedLayerNormalization",
        backends=("onnx",),
        models=("llama", "mistral", "qwen2", "qwen3"),
        kind="optimization",
        requires=("onnx/rms-norm-fusion",),
        examples=(
            Match(unscaled, "norm(x) + x: no weight multiply, hidden 37", atol=1e-5),
            # ORT's float32 rsqrt may differ from torch's in the last bit: one float16 ulp of the sum (4e-3 below 8).
            Match(unscaled_fp16, "the same in float16, normalised in float32", atol=4e-3),
            NoMatch(block, "a weighted RMSNorm: onnx/rms-norm-fusion fused it whole"),
            NoMatch(mean_over_sequence, "mean over the sequence axis"),
            NoMatch(cube, "mean of cubes"),
        ),
    ),
    rewrite_rule=rms_norm_core_rule,
)
