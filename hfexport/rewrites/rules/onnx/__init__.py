"""ONNX IR post-fixes and ONNX Runtime fusions (stage `onnx`), in the order they run.

Each rule runs in its phase of the stage (`OnnxRewriteRule.phase`), in this order within the phase: fixes
(phase "fix", right after translation: they make the graph valid for ORT), fusions (phase "fusion",
`kind="optimization"`: after the onnxscript optimizer, and only when `OnnxConfig.fusions` is set), and the rewrites
of what a quantizer wrote (phase "quantized", on the model the quantizer returned).
"""

from hfexport.rewrites.rule import Rule, load_rules

RULES: list[Rule] = load_rules(
    __name__,
    [
        # Fixes (run right after translation, before the optimizer).
        "onnx/keep-near-noop-constants",
        # Opt-in (NNCFOnnxQuantizer): a tied weight's Transpose, which the optimizer keeps, as an initializer.
        "onnx/fold-shared-weight-transpose",
        # Fusions (run after the optimizer).
        # RMSNorm: the whole norm first; the core rule takes what the weight-fused rule left.
        "onnx/rms-norm-fusion",
        "onnx/rms-norm-core-fusion",
        # Residual adds into the norms above (and LayerNormalization).
        "onnx/skip-rms-norm-fusion",
        "onnx/skip-layer-norm-fusion",
        "onnx/gelu-tanh-fusion",
        "onnx/rotary-embedding-fusion",
        "onnx/matmul-add-gemm-fusion",
        "onnx/index-copy-scatter-elements",
        # Grouped-query attention without repeat_kv first, so the rewrite below reads the key/value heads.
        "onnx/attention-drop-repeat-kv",
        "onnx/attention-as-matmul",
        # Phase "quantized": rewrites of what a weight quantizer wrote.
        "onnx/dequantized-gather-rows",
        # NNCF's int4 weights in groups at opset >= 21 (DequantizeLinear + MatMul) as its opset-20 MatMulNBits.
        "onnx/blocked-dequantize-matmul-nbits",
        # NNCF's int4 embedding table (all_layers) as GatherBlockQuantized; then a tied head's identical MatMulNBits
        # blocks and the table are one copy.
        "onnx/blocked-dequantize-gather",
        "onnx/tied-int4-table-once",
        # Opt-in (OnnxRuntimeQuantizer): attention-as-matmul once the tool has quantized the weights' MatMuls.
        "onnx/quantized-attention-as-matmul",
    ],
)
