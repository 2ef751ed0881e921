"""How an export runs a quantizer: the check before tracing, the FX and backend hand-offs, the op count.

`exporters/pipeline.py` calls `check_quantizer` before capture, `quantize_program` between capture and lowering
(quantizers with `quantizes_fx_graph`), and `quantize_backend_model` after lowering (the others). Each hand-off
returns the quantized object and a `QuantizationRecord` for the export report.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch

from hfexport.errors import ConfigError
from hfexport.formats import ExportFormat
from hfexport.quantizers.base import ExportQuantizer, jsonable
from hfexport.report import QuantizationRecord

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
_LOW_PRECISION = (torch.int8, torch.uint8, torch.int16, torch.int32)


def check_quantizer(quantizer: Any, export_format: str, config: Any = None) -> dict[str, str]:
    """Before tracing: the quantizer is one, fits `export_format` (and `config`), and its packages are there."""
    if not isinstance(quantizer, ExportQuantizer):
        raise ConfigError(
            f"quantizer must be an ExportQuantizer (PT2EQuantizer, NNCFOpenVINOQuantizer, OnnxRuntimeQuantizer, ...), "
            f"got {type(quantizer).__name__}"
        )
    quantizer.check_format(export_format)
    quantizer.check_keep_float()
    check_config = getattr(quantizer, "check_config", None)
    if check_config is not None and config is not None:
        check_config(config)
    return quantizer.validate_environment()


def _calibration_count(quantizer: ExportQuantizer) -> int | None:
    if not quantizer.needs_calibration:
        return 0
    dataset = quantizer.calibration_dataset
    if dataset is None:
        return 1
    try:
        return len(dataset)
    except TypeError:
        return None


def _record(quantizer: ExportQuantizer, stage: str, counts: dict[str, int], seconds: float) -> QuantizationRecord:
    return QuantizationRecord(
        quantizer=type(quantizer).__name__,
        stage=stage,
        settings=jsonable(
            {**quantizer.settings(), **({"keep_float": list(quantizer.keep_float)} if quantizer.keep_float else {})}
        ),
        op_counts=counts,
        seconds=seconds,
        calibration_samples=_calibration_count(quantizer),
    )


def reexport(
    module: torch.nn.Module,
    sample_inputs: Mapping[str, Any],
    options: Any,
) -> torch.export.ExportedProgram:
    """Export a quantized GraphModule again, with the dynamic shapes the capture used (`CaptureOptions`)."""
    from hfexport.cache_pytree import register_cache_pytrees
    from hfexport.frontends.torch_export import auto_dynamic_shapes

    register_cache_pytrees()
    inputs = dict(sample_inputs)
    if options.dynamic_shapes is not None:
        dynamic_shapes: dict[str, Any] | None = dict(options.dynamic_shapes)
    elif options.dynamic:
        dynamic_shapes = auto_dynamic_shapes(inputs)
    else:
        dynamic_shapes = None
    with torch.no_grad():
        return torch.export.export(
            module,
            (),
            inputs,
            dynamic_shapes=dynamic_shapes,
            strict=False,
            prefer_deferred_runtime_asserts_over_guards=options.prefer_deferred_runtime_asserts_over_guards,
        )


def fx_op_counts(program: Any) -> dict[str, int]:
    """Quantize/dequantize nodes by op, and integer weights (compressed constants) of a program or GraphModule."""
    graph_module = program.graph_module if isinstance(program, torch.export.ExportedProgram) else program
    counts: Counter[str] = Counter()
    for node in graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        name = str(node.target)
        namespace = name.split(".", 1)[0]
        if namespace in ("quantized_decomposed", "torchao") or "quantize" in name:
            counts[name.removesuffix(".default")] += 1
    tensors: dict[str, Any] = {}
    if isinstance(program, torch.export.ExportedProgram):
        tensors.update(program.state_dict)
        tensors.update(program.constants)
    else:
        tensors.update(dict(graph_module.named_parameters()))
        tensors.update(dict(graph_module.named_buffers()))
    for value in tensors.values():
        if isinstance(value, torch.Tensor) and value.dtype in _LOW_PRECISION and value.ndim >= 2:
            counts[f"compressed_constant.{str(value.dtype).removeprefix('torch.')}"] += 1
    return dict(counts)


def onnx_op_counts(model: Any) -> dict[str, int]:
    """Quantization ops of an ONNX model (`onnx_ir.Model` or `onnx.ModelProto`) by op type, subgraphs included."""
    counts: Counter[str] = Counter()
    if hasattr(model, "SerializeToString"):  # onnx.ModelProto
        nodes = [node.op_type for node in model.graph.node]
    else:
        import onnx_ir as ir

        nodes = [node.op_type for node in ir.traversal.RecursiveGraphIterator(model.graph)]
    for op_type in nodes:
        if op_type in ONNX_QUANTIZED_OPS:
            counts[op_type] += 1
    return dict(counts)


def openvino_op_counts(model: Any) -> dict[str, int]:
    """FakeQuantize ops and integer (compressed) weight constants of an `openvino.Model`."""
    counts: Counter[str] = Counter()
    for op in model.get_ops():
        kind = op.get_type_name()
        if kind == "FakeQuantize":
            counts[kind] += 1
        elif kind == "Constant":
            element = op.get_output_element_type(0).get_type_name()
            if element in ("i8", "u8", "i4", "u4", "nf4", "f8e4m3", "f8e5m2") and len(op.get_output_shape(0)) >= 2:
                counts[f"compressed_constant.{element}"] += 1
    return dict(counts)


def backend_op_counts(model: Any, export_format: str) -> dict[str, int]:
    if export_format == ExportFormat.ONNX.value:
        return onnx_op_counts(getattr(model, "model", model))
    if export_format == ExportFormat.OPENVINO.value:
        return openvino_op_counts(model)
    return {}


def quantize_program(
    quantizer: ExportQuantizer,
    program: torch.export.ExportedProgram,
    sample_inputs: Mapping[str, Any],
    options: Any,
    export_format: str,
) -> tuple[torch.export.ExportedProgram, QuantizationRecord]:
    """Run an FX quantizer on the captured program; return the re-exported quantized program and its record.

    Called inside the export's `quantize` stage, which names a failure (with the quantizer, see the pipeline).
    """
    start = time.perf_counter()
    name = type(quantizer).__name__
    quantized = quantizer.quantize(program.module(), sample_inputs, export_format)
    if not isinstance(quantized, torch.export.ExportedProgram):
        if not isinstance(quantized, torch.nn.Module):
            raise TypeError(f"{name}.quantize returned {type(quantized).__name__}, not a GraphModule")
        quantized = reexport(quantized, sample_inputs, options)
    seconds = time.perf_counter() - start
    return quantized, _record(quantizer, "fx", fx_op_counts(quantized), seconds)


def quantize_backend_model(
    quantizer: ExportQuantizer,
    result: Any,
    sample_inputs: Mapping[str, Any],
    export_format: str,
    program: torch.export.ExportedProgram | None = None,
) -> tuple[Any, QuantizationRecord]:
    """Run a backend quantizer on the lowered model (`ONNXProgram` or `openvino.Model`); return it and its record.

    `program`: the captured program the model was lowered from, whose nodes name the modules `keep_float` names.
    """
    from hfexport.quantizers.scopes import fx_node_modules, node_modules

    start = time.perf_counter()
    captured = fx_node_modules(program.graph_module) if program is not None and quantizer.keep_float else None
    with node_modules(captured):
        result = _quantize_backend_model(quantizer, result, sample_inputs, export_format)
    seconds = time.perf_counter() - start
    return result, _record(quantizer, export_format, backend_op_counts(result, export_format), seconds)


def _quantize_backend_model(
    quantizer: ExportQuantizer, result: Any, sample_inputs: Mapping[str, Any], export_format: str
) -> Any:
    if export_format == ExportFormat.ONNX.value:
        import onnx_ir as ir

        quantized = quantizer.quantize(result.model, sample_inputs, export_format)
        if not isinstance(quantized, ir.Model):
            quantized = ir.from_proto(quantized)
        result.model = quantized
        # A session built before quantization would run the float model.
        result.release()
    else:
        result = quantizer.quantize(result, sample_inputs, export_format)
    return result
