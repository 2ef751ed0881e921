"""ONNX IR post-fixes and ONNX Runtime fusions (stage `onnx`), in the order they run.

Fixes come first (they make the graph valid for ORT); fusions, which match the fixed graph, come after.
Fusions (`kind="optimization"`) run after the onnxscript optimizer, and only when `OnnxConfig.fusions`
is set.
"""

from hfexport.rewrites.rule import Rule
from hfexport.rewrites.rules.onnx.attention_as_matmul import attention_as_matmul
from hfexport.rewrites.rules.onnx.attention_drop_repeat_kv import attention_drop_repeat_kv
from hfexport.rewrites.rules.onnx.gelu_tanh_fusion import gelu_tanh_fusion
from hfexport.rewrites.rules.onnx.index_copy_scatter_elements import index_copy_scatter_elements
from hfexport.rewrites.rules.onnx.keep_near_noop_constants import keep_near_noop_constants
from hfexport.rewrites.rules.onnx.matmul_add_gemm_fusion import matmul_add_gemm_fusion
from hfexport.rewrites.rules.onnx.rms_norm_core_fusion import rms_norm_core_fusion
from hfexport.rewrites.rules.onnx.rms_norm_fusion import rms_norm_fusion
from hfexport.rewrites.rules.onnx.rotary_embedding_fusion import rotary_embedding_fusion
from hfexport.rewrites.rules.onnx.skip_layer_norm_fusion import skip_layer_norm_fusion
from hfexport.rewrites.rules.onnx.skip_rms_norm_fusion import skip_rms_norm_fusion

RULES: list[Rule] = [
    # Fixes (run right after translation, before the optimizer).
    keep_near_noop_constants,
    # Fusions (run after the optimizer).
    # RMSNorm: the whole norm first; the core rule takes what the weight-fused rule left.
    rms_norm_fusion,
    rms_norm_core_fusion,
    # Residual adds into the norms above (and LayerNormalization).
    skip_rms_norm_fusion,
    skip_layer_norm_fusion,
    gelu_tanh_fusion,
    rotary_embedding_fusion,
    matmul_add_gemm_fusion,
    index_copy_scatter_elements,
    # Grouped-query attention without repeat_kv first, so the rewrite below reads the key/value heads.
    attention_drop_repeat_kv,
    attention_as_matmul,
]
