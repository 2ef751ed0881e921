"""ONNX: `torch.onnx.ONNXProgram` (the Dynamo program translated by torch.onnx and onnxscript), run by ONNX Runtime."""

from hfexport.backends.descriptor import Backend, Ref

BACKEND = Backend(
    name="onnx",
    package=__name__,
    main_file="model.onnx",
    native_classes=("torch.onnx:ONNXProgram",),
    side_suffixes=(".data",),
    config=Ref(".config:OnnxConfig"),
    exporter=Ref(".exporter:OnnxExporter"),
    stages=("patch", "fx", "aten", "onnx"),
    devices=("cpu", "cuda[:N]"),
    # ONNX Runtime's fused kernels (RMSNorm, rotary) reorder float sums.
    tolerance=1e-3,
    streams_weights=True,
    no_bfloat16="ONNX Runtime's CPU provider has no bfloat16 kernels (MatMul, Add, ...: a bf16 file does not load)",
)
