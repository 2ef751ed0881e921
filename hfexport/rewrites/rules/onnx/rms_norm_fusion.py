"""Rule `onnx/rms-norm-fusion` (shared code: `_fusions_norm`)."""

from __future__ import annotations

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.onnx import OnnxRewriteRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.onnx._fusions_norm import _block, _cube, _float16_text, _mean_over_sequence, _rms_norm_rule

rms_norm_fusion = OnnxRewriteRule(
    meta=RuleMeta(
        id="onnx/rms-norm-fusion",
        why="one SimplifiedLayerNormalization kernel instead of seven ops per RMSNorm on ONNX Runtime",
        upstream="onnxruntime==1.32.0 contrib op SimplifiedLayerNormalization",
        backends=("onnx",),
        models=("llama", "mistral", "qwen2", "qwen3"),
        kind="optimization",
        examples=(
            Match(_block, "Linear -> RMSNorm (hidden 37, eps 1e-6) -> Linear, float32", atol=1e-5),
            NoMatch(_float16_text, "float16 upcast form: the weight multiply is in float16, left to the core rule"),
            NoMatch(_mean_over_sequence, "mean over the sequence axis"),
            NoMatch(_cube, "mean of cubes"),
        ),
    ),
    rewrite_rule=_rms_norm_rule,
)
