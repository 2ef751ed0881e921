"""Rule `onnx/attention-as-matmul` (shared code: `_fusions_attention`)."""

from __future__ import annotations

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.onnx import OnnxRewriteRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.onnx._fusions_attention import (
    attention_matmul_rule,
    broadcast_row_mask,
    grouped_no_repeat,
    key_padding,
    symbolic_mask_rows,
)

attention_as_matmul = OnnxRewriteRule(
    meta=RuleMeta(
        id="onnx/attention-as-matmul",
        why="ONNX Runtime 1.32 has no CPU kernel for Attention-25 and inlines its ~60-node function body per "
        "layer; MatMul/Softmax/MatMul over grouped heads runs as fast as the opset-24 kernel"
        "; measured by tools/ab_rules.py (8 layers at SmolLM2-135M's width, batch 1, 128-token "
        "prompt, 64 new tokens, ONNX Runtime 1.32 CPU, 2-core AVX2 EPYC): decode 1.15x on the Llama (125.8 "
        "against 109.0 tok/s without the rule), 1.33x on GPT-2 (156.5 against 117.6), tokens equal",
        upstream="onnxruntime==1.32.0 onnxruntime/core/providers/cpu/cpu_execution_provider.cc registers the CPU "
        "Attention kernel for opsets 23 and 24 only (a kernel registered without an end version matches its start "
        "version only, cf. https://github.com/microsoft/onnxruntime/pull/32201)",
        backends=("onnx",),
        models=("llama", "mistral", "qwen2", "qwen3", "gemma"),
        kind="optimization",
        examples=(
            Match(grouped_no_repeat, "6 query / 2 key-value heads, boolean mask, one fully masked row", opset=25),
            Match(key_padding, "a [b, 1, 1, kv] key-padding mask over 4 queries, one batch fully masked", opset=25),
            Match(broadcast_row_mask, "a [1, kv] mask shared by 4 queries and both batches", opset=25),
            Match(symbolic_mask_rows, "mask rows a symbol other than the query's, fed one row: widened first"),
            NoMatch(grouped_no_repeat, "opset 24: ONNX Runtime's Attention kernel runs it", opset=24),
        ),
    ),
    rewrite_rule=attention_matmul_rule,
)
