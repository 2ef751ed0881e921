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
    """int8: ONNX Runtime's dynamic quantization; int4: NNCF's weight compression (`_int4`)."""
    from hfexport.quantizers.nncf import NNCFOnnxQuantizer
    from hfexport.quantizers.onnxruntime import OnnxRuntimeDynamicConfig, OnnxRuntimeQuantizer

    if precision == "int8":
        return OnnxRuntimeQuantizer(OnnxRuntimeDynamicConfig())
    return NNCFOnnxQuantizer(_int4())


def _int4() -> Any:
    """NNCF int4 for ONNX Runtime with the output projection in int4 too (`all_layers`): by default NNCF keeps it in
    int8 per channel, which ONNX Runtime runs either as a `DequantizeLinear` of the whole matrix every call (49152 x
    576 floats written and read per token at the SmolLM2 shape) or, with a positive axis, fused into an 8-bit
    `MatMulNBits` that quantizes the activations (accuracy level 4). The embedding's `Gather` is left out: NNCF 3.4
    with `all_layers` replaces it with a `MatMulNBits` of the token ids, which ONNX Runtime refuses ("Type
    'tensor(int64)' of input parameter (input_ids) of operator (MatMulNBits) ... is invalid"); it stays float and a
    step reads one row of it."""
    import nncf

    from hfexport.quantizers.nncf import NNCFWeightCompressionConfig

    return NNCFWeightCompressionConfig(
        mode="int4_sym", group_size=32, all_layers=True, ignored_scope=nncf.IgnoredScope(types=["Gather"])
    )


TOOLS = Tools(run=run, structure=structure, bench_quantizer=bench_quantizer)
