"""ONNX IR post-fixes and ONNX Runtime fusions (stage `onnx`), in the order they run.

Fixes come first (they make the graph valid for ORT); fusions, which match the fixed graph, come after.
Fusions (`kind="optimization"`) run after the onnxscript optimizer, and only when `OnnxConfig.fusions`
is set.
"""

from hfexport.rewrites.onnx import fusions_norm

RULES: list = [
    # RMSNorm: the whole norm first; the core rule takes what the weight-fused rule left.
    fusions_norm.rms_norm,
    fusions_norm.rms_norm_core,
]
