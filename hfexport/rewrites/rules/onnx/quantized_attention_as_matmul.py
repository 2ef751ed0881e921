"""Rule `onnx/quantized-attention-as-matmul`: `onnx/attention-as-matmul` after ONNX Runtime's quantization tool.

OnnxRuntimeQuantizer turns `onnx/attention-as-matmul` off, because the tool quantizes every MatMul and would
quantize the attention scores too. Left as `Attention-25`, ONNX Runtime 1.32 (no CPU kernel at that opset) inlines
its function body in every layer. Once the tool has run, the same rewrite leaves the scores float.
"""

from __future__ import annotations

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.onnx import OnnxRewriteRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.onnx._fusions_attention import attention_matmul_rule, grouped_no_repeat, key_padding

quantized_attention_as_matmul = OnnxRewriteRule(
    meta=RuleMeta(
        id="onnx/quantized-attention-as-matmul",
        why="OnnxRuntimeQuantizer disables onnx/attention-as-matmul (the tool would quantize the scores' MatMuls), "
        "so its models kept Attention-25, whose ~60-node function body ORT 1.32 inlines per layer: in the "
        "30-layer SmolLM2-135M dynamic int8 decode step those nodes were 75 % of the node time (29.5 of 39.2 ms, "
        "ORT profile, docs/benchmarks/history/) against 25 % for the weight MatMuls. Run after "
        "the tool, the rewrite leaves the scores float and computes what Attention computes: the 30-layer int8 "
        "decode went from 45.2 to 86.0 tok/s, tokens equal to fp32 eager's",
        upstream="onnxruntime==1.32.0 onnxruntime/core/providers/cpu/cpu_execution_provider.cc registers the CPU "
        "Attention kernel for opsets 23 and 24 only",
        backends=("onnx",),
        models=("llama", "mistral", "qwen2", "qwen3", "gemma"),
        kind="optimization",
        # Opt-in: OnnxRuntimeQuantizer enables it in place of the rule it disables.
        enabled_by_default=False,
        examples=(
            Match(grouped_no_repeat, "6 query / 2 key-value heads, boolean mask, one fully masked row", opset=25),
            Match(key_padding, "a [b, 1, 1, kv] key-padding mask over 4 queries, one batch fully masked", opset=25),
            NoMatch(grouped_no_repeat, "opset 24: ONNX Runtime's Attention kernel runs it", opset=24),
        ),
    ),
    rewrite_rule=attention_matmul_rule,
    phase="quantized",
)
