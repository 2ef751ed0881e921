"""ONNX IR post-fixes and ONNX Runtime fusions (stage `onnx`), in the order they run.

Fixes come first (they make the graph valid for ORT); fusions, which match the fixed graph, come after.
Fusions (`kind="optimization"`) run after the onnxscript optimizer, and only when `OnnxConfig.fusions`
is set.
"""

from hfexport.rewrites.onnx import (
    fusions_attention,
    fusions_cache,
    fusions_gelu,
    fusions_gemm,
    fusions_norm,
    fusions_rotary,
    fusions_skip_norm,
    near_noop_constants,
)

RULES: list = [
    # Fixes (run right after translation, before the optimizer).
    near_noop_constants.keep_near_noop_constants,
    # Fusions (run after the optimizer).
    # RMSNorm: the whole norm first; the core rule takes what the weight-fused rule left.
    fusions_norm.rms_norm,
    fusions_norm.rms_norm_core,
    # Residual adds into the norms above (and LayerNormalization).
    fusions_skip_norm.skip_rms_norm,
    fusions_skip_norm.skip_layer_norm,
    fusions_gelu.gelu_tanh,
    fusions_rotary.rotary,
    fusions_gemm.matmul_add_to_gemm,
    fusions_cache.index_copy_scatter,
    # Grouped-query attention without repeat_kv first, so the rewrite below reads the key/value heads.
    fusions_attention.attention_gqa,
    fusions_attention.attention_matmul,
]
