"""How an export runs a quantizer: the check before tracing, the FX and backend hand-offs, the FX op count.

`exporters/pipeline.py` calls `check_quantizer` before capture, `quantize_eager_model` before capture (quantizers
with `quantizes_eager_model`), `quantize_program` between capture and lowering (`quantizes_fx_graph`), and
`quantize_backend_model` after lowering (the others). Each hand-off returns the quantized object and a
`QuantizationRecord` for the export report.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from hfexport.backends.dynamo.ops import fx_quantized_op_counts
from hfexport.backends.registry import backend
from hfexport.core.errors import ConfigError
from hfexport.quantizers.base import ExportQuantizer, jsonable
from hfexport.report import QuantizationRecord


def check_quantizer(quantizer: Any, export_format: str, config: Any = None) -> dict[str, str]:
    """Before tracing: the quantizer is one, fits `export_format` (and `config`), and its packages are there."""
    if not isinstance(quantizer, ExportQuantizer):
        raise ConfigError(
            f"quantizer must be an ExportQuantizer (PT2EQuantizer, NNCFOpenVINOQuantizer, OnnxRuntimeQuantizer, ...), "
            f"got {type(quantizer).__name__}"
        )
    if quantizer.quantizes_fx_graph and quantizer.quantizes_eager_model:
        raise ConfigError(f"{type(quantizer).__name__} sets both quantizes_fx_graph and quantizes_eager_model")
    quantizer.check_format(export_format)
    quantizer.check_keep_float()
    check_config = getattr(quantizer, "check_config", None)
    if check_config is not None and config is not None:
        check_config(config)
    return quantizer.validate_environment()


def failure_message(quantizer: Any) -> Callable[[BaseException], str]:
    """How the export's `quantize` stage words a failure: the quantizer, then what went wrong."""
    name = type(quantizer).__name__
    return lambda exc: f"{name}: {type(exc).__name__}: {exc}"


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
    from hfexport.core.cache_pytree import register_cache_pytrees
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


# The attribute of a model `quantize_eager_model` made: (the quantizer's `to_dict()`, its record).
_QUANTIZED_BY = "_hfexport_quantized_by"


def quantize_eager_model(
    quantizer: ExportQuantizer,
    model: torch.nn.Module,
    sample_inputs: Mapping[str, Any],
    export_format: str,
) -> tuple[torch.nn.Module, QuantizationRecord]:
    """Run an eager-model quantizer on `model`; return the quantized copy and its record (`model` is unchanged).

    A model that holds a module this function already made with an equal quantizer (a generation component
    wrapping the one quantized copy `export_for_generation` made) is returned as it is, with that record."""
    for module in model.modules():
        made = getattr(module, _QUANTIZED_BY, None)
        if made is not None and made[0] == quantizer.to_dict():
            return model, dataclasses.replace(made[1], seconds=0.0)
    start = time.perf_counter()
    quantized = quantizer.quantize(model, sample_inputs, export_format)
    if quantized is model or not isinstance(quantized, torch.nn.Module):
        raise TypeError(f"{type(quantizer).__name__}.quantize must return a quantized copy of the model")
    seconds = time.perf_counter() - start
    record = _record(quantizer, "eager", eager_quantized_op_counts(quantized), seconds)
    setattr(quantized, _QUANTIZED_BY, (quantizer.to_dict(), record))
    return quantized, record


def eager_quantized_op_counts(model: torch.nn.Module) -> dict[str, int]:
    """{weight tensor class: how many} of the quantized (tensor-subclass) weights of an eager model's modules."""
    counts: dict[str, int] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor) and type(weight) not in (torch.Tensor, torch.nn.Parameter):
            name = type(weight).__name__
            counts[name] = counts.get(name, 0) + 1
    return counts


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
    return quantized, _record(quantizer, "fx", fx_quantized_op_counts(quantized), seconds)


def quantize_backend_model(
    quantizer: ExportQuantizer,
    result: Any,
    sample_inputs: Mapping[str, Any],
    export_format: str,
    program: torch.export.ExportedProgram | None = None,
) -> tuple[Any, QuantizationRecord]:
    """Run a backend quantizer on the lowered model (`ONNXProgram` or `openvino.Model`); return it and its record.

    The backend says which model inside its result the quantizer takes and how the quantized one goes back, and
    counts its quantization ops (`Ops`). `program`: the captured program the model was lowered from, whose nodes
    name the modules `keep_float` names.
    """
    from hfexport.quantizers.scopes import fx_node_modules, node_modules

    ops = backend(export_format).ops.load()
    start = time.perf_counter()
    captured = fx_node_modules(program.graph_module) if program is not None and quantizer.keep_float else None
    with node_modules(captured):
        quantized = quantizer.quantize(ops.backend_model(result), sample_inputs, export_format)
    result = ops.with_backend_model(result, quantized)
    seconds = time.perf_counter() - start
    return result, _record(quantizer, export_format, ops.quantized_op_counts(result), seconds)
