"""What the example harness and `hfexport bench` do for ONNX: ONNX Runtime on the CPU, ORT's and NNCF's recipes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hfexport.backends.descriptor import Tools


def run(program: Any, inputs: Mapping[str, Any]) -> Any:
    import onnxruntime as ort

    from hfexport.naming import onnx_feed

    session = ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, onnx_feed([i.name for i in session.get_inputs()], inputs))


def structure(program: Any) -> list[tuple[Any, ...]]:
    """Nodes, wiring and attributes, without metadata: onnxscript's rewriter annotates Constant nodes even
    when no rule matches, so a text comparison would call an untouched graph changed."""
    return [
        (
            node.domain,
            node.op_type,
            tuple(v.name if v is not None else "" for v in node.inputs),
            tuple(v.name for v in node.outputs),
            tuple(sorted((k, repr(a.value)) for k, a in node.attributes.items())),
        )
        for node in program.model.graph
    ]


def bench_quantizer(precision: str) -> Any:
    """int8: ONNX Runtime's dynamic quantization; int4: NNCF's weight compression (`int4_recipe`)."""
    from hfexport.quantizers.nncf import NNCFOnnxQuantizer
    from hfexport.quantizers.onnxruntime import OnnxRuntimeDynamicConfig, OnnxRuntimeQuantizer

    if precision == "int8":
        return OnnxRuntimeQuantizer(OnnxRuntimeDynamicConfig())
    return NNCFOnnxQuantizer(int4_recipe())


def int4_recipe() -> Any:
    """NNCF int4 for ONNX Runtime, every layer in int4 (`all_layers`), as onnxruntime-genai's int4 build: by default
    NNCF keeps the output projection and the embedding in int8 per channel. The head becomes a `MatMulNBits`, the
    embedding a `GatherBlockQuantized` (`onnx/blocked-dequantize-gather`), and a tied pair reads one copy of the 4-bit
    table (`onnx/tied-int4-table-once`)."""
    from hfexport.quantizers.nncf import NNCFWeightCompressionConfig

    return NNCFWeightCompressionConfig(mode="int4_sym", group_size=32, all_layers=True)


TOOLS = Tools(run=run, structure=structure, bench_quantizer=bench_quantizer)
