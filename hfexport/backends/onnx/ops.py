"""How the ops of an ONNX model are counted: `op_type`, or `domain.op_type` outside the default domain."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from hfexport.backends.descriptor import Ops

# ONNX ops that carry quantization: QDQ pairs, integer matmuls (dynamic quantization), ORT's quantized
# contrib ops, and blocked weight-only matmuls.
ONNX_QUANTIZED_OPS = frozenset(
    {
        "QuantizeLinear",
        "DequantizeLinear",
        "DynamicQuantizeLinear",
        "MatMulInteger",
        "ConvInteger",
        "QLinearMatMul",
        "QLinearConv",
        "MatMulNBits",
        "GatherBlockQuantized",
        "DynamicQuantizeMatMul",
        "QAttention",
        "QGemm",
        "MatMulIntegerToFloat",
    }
)


def _name(domain: str, op_type: str) -> str:
    return f"{domain}.{op_type}" if domain and domain != "ai.onnx" else op_type


def _nodes(model: Any) -> Any:
    """(domain, op_type) of every node of an ONNX model: an `ONNXProgram`, `onnx_ir.Model` or `onnx.ModelProto`,
    subgraphs included."""
    model = getattr(model, "model", model)  # an ONNXProgram holds its onnx_ir.Model
    if hasattr(model, "SerializeToString"):  # onnx.ModelProto
        return ((node.domain, node.op_type) for node in model.graph.node)
    return ((node.domain, node.op_type) for node in model.graph.all_nodes())


def op_counts(model: Any) -> Counter[str]:
    return Counter(_name(domain, op_type) for domain, op_type in _nodes(model))


def quantized_op_counts(model: Any) -> dict[str, int]:
    """The quantization ops of an ONNX model by op type (`ONNX_QUANTIZED_OPS`)."""
    counts: Counter[str] = Counter()
    for _domain, op_type in _nodes(model):
        if op_type in ONNX_QUANTIZED_OPS:
            counts[op_type] += 1
    return dict(counts)


def _runtime_op_counts(folder: Path) -> tuple[str, Counter[str]]:
    """The graph ONNX Runtime runs after its own optimizations (function bodies inlined, contrib fusions), which is
    what an ONNX-level fusion changes."""
    import onnx
    import onnxruntime as ort

    folder = Path(folder)
    counts: Counter[str] = Counter()
    for index, path in enumerate(sorted(folder.rglob("*.onnx"))):
        options = ort.SessionOptions()
        optimized = folder / f".hfexport-audit-optimized-{index}.onnx"
        options.optimized_model_filepath = str(optimized)
        ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        counts.update(op_counts(onnx.load(str(optimized), load_external_data=False)))
    return "ONNX Runtime's optimized CPU graph", counts


def _with_model(program: Any, model: Any) -> Any:
    """The `ONNXProgram` holding the quantized model (an `onnx_ir.Model`, or a `ModelProto` the quantizer gave)."""
    import onnx_ir as ir

    program.model = model if isinstance(model, ir.Model) else ir.from_proto(model)
    # A session built before quantization would run the float model.
    program.release()
    return program


OPS = Ops(
    op_counts=op_counts,
    quantized_op_counts=quantized_op_counts,
    runtime_op_counts=_runtime_op_counts,
    backend_model=lambda program: program.model,
    with_backend_model=_with_model,
)
