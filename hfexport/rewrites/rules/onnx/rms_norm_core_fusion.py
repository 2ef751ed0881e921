"""Rule `onnx/rms-norm-core-fusion` (shared code: `_fusions_norm`)."""

from __future__ import annotations

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.onnx import OnnxRewriteRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.onnx._fusions_norm import (
    _cube,
    _mean_over_sequence,
    _rms_fp16,
    _rms_norm_core_rule,
    _rms_weight_last,
)

rms_norm_core_fusion = OnnxRewriteRule(
    meta=RuleMeta(
        id="onnx/rms-norm-core-fusion",
        why="fuses the normalisation of RMSNorms whose weight multiply must stay apart (float16 upcast)",
        upstream="onnxruntime==1.32.0 contrib op SimplifiedLayerNormalization",
        backends=("onnx",),
        models=("llama", "mistral", "qwen2", "qwen3"),
        kind="optimization",
        examples=(
            # ORT's float32 rsqrt may differ from torch's in the last bit: one float16 ulp (2e-3 below 4).
            Match(_rms_fp16, "float16 input, float32 normalisation, float16 weight (hidden 37)", atol=2e-3),
            Match(_rms_weight_last, "norm(x) * weight, hidden 33", atol=1e-5),
            NoMatch(_mean_over_sequence, "mean over the sequence axis"),
            NoMatch(_cube, "mean of cubes"),
        ),
    ),
    rewrite_rule=_rms_norm_core_rule,
)
