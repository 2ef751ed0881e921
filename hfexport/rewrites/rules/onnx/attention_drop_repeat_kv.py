"""Rule `onnx/attention-drop-repeat-kv` (shared code: `_fusions_attention`)."""

from __future__ import annotations

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.onnx import OnnxRewriteRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.onnx._fusions_attention import gqa_rule, grouped_example, tiled_example

attention_drop_repeat_kv = OnnxRewriteRule(
    meta=RuleMeta(
        id="onnx/attention-drop-repeat-kv",
        why="repeat_kv (Unsqueeze/Expand/Reshape copying the key and value cache per layer and step) before a "
        "standard Attention node is dropped: the op reads fewer key/value heads itself"
        "; measured by tools/ab_rules.py (8 layers at SmolLM2-135M's width, batch 1, 128-token "
        "prompt, 64 new tokens, ONNX Runtime 1.32 CPU, 2-core AVX2 EPYC): decode 1.05x on the Llama (125.8 "
        "against 119.6 tok/s), tokens equal",
        upstream="onnx==1.23.2 docs/Operators.md Attention-23 (kv_num_heads below q_num_heads: grouped-query attention "
        "inside the op)",
        backends=("onnx",),
        models=("llama", "mistral", "qwen2", "qwen3", "gemma"),
        kind="optimization",
        examples=(
            Match(grouped_example, "6 query / 2 key-value heads, boolean mask with a left-padded row", opset=24),
            NoMatch(tiled_example, "key/value heads tiled with repeat(), not grouped", opset=24),
        ),
    ),
    rewrite_rule=gqa_rule,
)
