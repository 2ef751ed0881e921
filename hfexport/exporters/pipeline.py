"""The export pipeline, written once for every format (`CaptureExporter`), the backend's part of it (`Lowering`),
and the selection it runs with."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from hfexport.configs import ExportConfigMixin
from hfexport.core.errors import ConfigError, HfExportError
from hfexport.exporters.base import _API_ERRORS, HfExporter, exclusive, logger
from hfexport.exporters.preflight import bfloat16_upcast, preflight
from hfexport.generation_spec import IMAGE_COUNT_META, STATIC_AXES_META
from hfexport.report import ExportReport
from hfexport.rewrites.rule import RuleSelection


def effective_selection(config: ExportConfigMixin, quantizer: Any = None) -> RuleSelection:
    """The one rule selection an export runs with: the config's, plus what the quantizer and config switch off.

    A quantizer's `disabled_rules` and `OnnxConfig(fusions=None)` are disabled here, each with its reason, so
    the engine has one place that decides whether a rule runs and the report says why one did not. A
    quantizer's `enabled_rules` (opt-in rules its toolkit needs) are enabled unless the config disables them.
    """
    from hfexport.rewrites.engine import default_registry

    selection = config.rules
    if quantizer is not None and quantizer.disabled_rules:
        selection = selection.with_disabled(
            quantizer.disabled_rules, f"{type(quantizer).__name__} cannot work with this rule's output"
        )
    if quantizer is not None and quantizer.enabled_rules:
        selection = selection.with_enabled(quantizer.enabled_rules)
    if getattr(config, "fusions", "") is None:
        fusions = [r.id for r in default_registry().rules("onnx") if r.meta.kind == "optimization"]
        selection = selection.with_disabled(fusions, "OnnxConfig.fusions is None")
    return selection


def _mutates(program: torch.export.ExportedProgram) -> bool:
    """Whether the graph writes into one of its inputs (an in-place or out= op on an input or a view of one).

    Writes into intermediates (a vision tower's `x[mask] = y`) run as they are and need no functionalisation,
    whose re-trace would also lose what the first trace knew (layouts baked into a component)."""
    for node in program.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        for argument, value in zip(schema.arguments, node.args, strict=False):
            if argument.alias_info is not None and argument.alias_info.is_write and _input_behind(value):
                return True
        if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments[len(node.args) :]):
            return True  # a written keyword argument (out=): keep the conservative answer
    return False


def _input_behind(value: Any) -> bool:
    """Whether `value` is a graph input or a view of one (through view ops such as slice, select, view)."""
    while isinstance(value, torch.fx.Node):
        if value.op == "placeholder":
            return True
        schema = getattr(value.target, "_schema", None)
        if value.op != "call_function" or schema is None or not schema.returns:
            return False
        alias = schema.returns[0].alias_info
        if alias is None or alias.is_write or not value.args:
            return False  # a fresh tensor (not a view)
        value = value.args[0]
    return False


def _weights_dtype(model: torch.nn.Module) -> str:
    """The dtype(s) of the model's floating-point parameters, e.g. `float32` or `bfloat16+float32`."""
    dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point()})
    return "+".join(dtypes) or "none"


class Lowering:
    """A backend's part of the export pipeline: everything after the capture that differs between formats.

    This base is the Dynamo lowering (the captured program, in-place writes functionalised); a backend overrides
    what it does differently, and its exporter holds one instance (`CaptureExporter.lowering`).
    """

    # `config.low_memory`: the weight source is found before the trace and handed to `lower` (ONNX, OpenVINO).
    streams_weights: ClassVar[bool] = False

    def check(self, config: ExportConfigMixin) -> None:
        """Refuse a config before tracing (a backend needing a device this machine lacks fails in milliseconds)."""

    def capture_options(
        self, model: torch.nn.Module, sample_inputs: Mapping[str, Any], config: ExportConfigMixin, warnings: list[str]
    ) -> Any:
        """How to trace: the config's capture fields. A backend may bound or narrow the shapes here."""
        from hfexport.frontends.torch_export import CaptureOptions

        return CaptureOptions(
            dynamic=config.dynamic,
            dynamic_shapes=config.dynamic_shapes,
            strict=config.strict,
            prefer_deferred_runtime_asserts_over_guards=config.prefer_deferred_runtime_asserts_over_guards,
        )

    def lower(
        self, program: torch.export.ExportedProgram, config: ExportConfigMixin, context: Any, weights: Any
    ) -> Any:
        """The backend's model of the captured program; `weights` is the low-memory weight source (or None)."""
        return functionalized(program, context)

    def finish(self, result: Any, config: ExportConfigMixin, context: Any, notes: list[str]) -> Any:
        """The backend's last step on the lowered (and quantized) model, before it is saved: none by default.
        A step that must see the quantized model (OpenVINO's stateful cache) goes here, not in `lower`."""
        return result

    def used(self, result: Any, config: ExportConfigMixin, context: Any) -> dict[str, Any]:
        """What this backend's export used where the config left a choice (for the report)."""
        return {}

    def save(self, result: Any, config: ExportConfigMixin) -> None:
        """Save a lowered (and quantized) model to `config.output_path`: every file complete, or none of them."""
        raise ConfigError(f"{type(config).__name__} has no output_path to save a model to")


def functionalized(program: torch.export.ExportedProgram, context: Any) -> torch.export.ExportedProgram:
    """`program` with every write into an input functionalised (the Dynamo lowering).

    torch.export keeps in-place ops (a static cache's index_copy_) in its graph; functionalising turns each write
    into a USER_INPUT_MUTATION, the form the contract documents and runtimes rely on."""
    if _mutates(program):
        from hfexport.frontends.functionalize import functionalize_input_writes

        with context.stage("lower"):
            # The same form, by a local edit where every write is an in-place op on an input itself (a static
            # cache's update); a re-trace of the whole program otherwise.
            program = functionalize_input_writes(program) or program.run_decompositions({})
    return program


class CaptureExporter(HfExporter):
    """The one export pipeline: preflight, capture (patch, trace, fx), lowering, quantizer, save, report (an
    eager-model quantizer runs before the capture, on a copy of the model).

    An exporter names its backend (`export_format`, `config_class`) and holds its `lowering`: nothing else
    differs between formats.
    """

    lowering: ClassVar[Lowering] = Lowering()

    def export(
        self, model: torch.nn.Module, sample_inputs: Mapping[str, Any], config: ExportConfigMixin | None = None
    ) -> Any:
        config = self.check_config(config)
        self.lowering.check(config)
        weights = None
        if self.lowering.streams_weights and getattr(config, "low_memory", False):
            from hfexport.exporters.low_memory import low_memory_weights

            # Found and checked before any trace; held for this one export only.
            weights = low_memory_weights(model, config)
        return self._capture_and_lower(model, sample_inputs, config, weights)

    def _capture_and_lower(
        self, model: torch.nn.Module, sample_inputs: Mapping[str, Any], config: ExportConfigMixin, weights: Any
    ) -> Any:
        from hfexport.frontends.torch_export import capture
        from hfexport.rewrites.engine import RewriteContext

        config, versions, notes = preflight(self, model, sample_inputs, config)
        output_path = getattr(config, "output_path", None)
        quantizer = getattr(config, "quantizer", None)
        # The lowering never writes: the result is saved here, at stage "save", all or nothing.
        unsaved = dataclasses.replace(config, output_path=None) if output_path is not None else config

        # A backend that compiles another's program runs that backend's rules too (`Backend.rules`, `Rule.applies_to`).
        context = RewriteContext(backend=str(self.export_format), selection=effective_selection(config, quantizer))
        lowering = self.lowering
        warnings: list[str] = []
        quantization = None
        result = None
        image_count: dict[str, int] = {}
        static_axes: dict[str, dict[str, int]] = {}
        start = time.perf_counter()
        try:
            with exclusive():
                options = lowering.capture_options(model, sample_inputs, config, warnings)
                upcast = bfloat16_upcast(self.export_format, model, sample_inputs)
                if upcast is not None:
                    warnings.append(upcast)
                    options = dataclasses.replace(options, upcast_bfloat16=True)
                traced = model
                if quantizer is not None and quantizer.quantizes_eager_model:
                    traced, quantization = self._quantize_eager(quantizer, model, sample_inputs, context)
                program = capture(traced, sample_inputs, options, context, warnings)
                image_count = dict(program.graph_module.meta.get(IMAGE_COUNT_META) or {})
                static_axes = dict(program.graph_module.meta.get(STATIC_AXES_META) or {})
                if quantizer is None or quantization is not None:
                    result = lowering.lower(program, unsaved, context, weights)
                else:
                    result, quantization = self._quantize_and_lower(
                        quantizer, program, sample_inputs, options, unsaved, context, weights
                    )
                result = lowering.finish(result, unsaved, context, notes)
                if output_path is not None:
                    with context.stage("save"):
                        lowering.save(result, config)
        except HfExportError as exc:
            if exc.rule_id is not None or context.current_rule is None:
                raise
            # A stage that caught a failure inside a rule's code (a patch replacement during the trace) names the
            # stage only; the engine knows which rule was running.
            raise HfExportError(
                exc.detail, stage=exc.stage, rule_id=context.current_rule, model=exc.model or type(model).__name__
            ) from (exc.__cause__ or exc)
        except _API_ERRORS:
            raise
        except Exception as exc:
            # Whatever failed (a rule, torch, a backend, a hook), the caller learns where: the stage and rule
            # the engine was in. The original exception is chained as __cause__.
            raise HfExportError(
                f"{type(exc).__name__}: {exc}",
                stage=context.current_stage or "export",
                rule_id=context.current_rule,
                model=type(model).__name__,
            ) from exc
        finally:
            for warning in warnings:
                logger.warning("%s: %s", type(model).__name__, warning)
            self.report = ExportReport.from_context(
                context,
                export_format=self.export_format,
                model_class=type(model).__name__,
                model_type=getattr(getattr(model, "config", None), "model_type", None),
                total_seconds=time.perf_counter() - start,
                warnings=warnings,
                notes=notes,
                versions=versions,
                quantization=quantization,
                used={
                    "dtype": _weights_dtype(model),
                    # Pixel inputs whose image count the graph holds for (`hfexport.load(...).run` checks it).
                    **({"image_count": image_count} if image_count else {}),
                    # Other axes asked dynamic that the trace fixed (`frontends.torch_export.specialised_axes`).
                    **({"static_axes": static_axes} if static_axes else {}),
                    **(lowering.used(result, config, context) if result is not None else {}),
                },
            )
        return result

    def _quantize_eager(
        self, quantizer: Any, model: torch.nn.Module, sample_inputs: Mapping[str, Any], context: Any
    ) -> tuple[torch.nn.Module, Any]:
        """The quantized copy of the eager `model` that is captured instead of it, and its record."""
        from hfexport.quantizers.apply import failure_message, quantize_eager_model

        with context.stage("quantize", message=failure_message(quantizer)):
            return quantize_eager_model(quantizer, model, sample_inputs, self.export_format)

    def _quantize_and_lower(
        self,
        quantizer: Any,
        program: torch.export.ExportedProgram,
        sample_inputs: Mapping[str, Any],
        options: Any,
        config: ExportConfigMixin,
        context: Any,
        weights: Any,
    ) -> tuple[Any, Any]:
        """Lower with `quantizer` applied: on the FX graph before lowering, or on the backend's model after it
        (the caller saves afterwards, so a saved artifact is the quantized one)."""
        from hfexport.quantizers.apply import failure_message, quantize_backend_model, quantize_program

        failure = failure_message(quantizer)
        if quantizer.quantizes_fx_graph:
            with context.stage("quantize", message=failure):
                program, record = quantize_program(quantizer, program, sample_inputs, options, self.export_format)
            return self.lowering.lower(program, config, context, weights), record
        result = self.lowering.lower(program, config, context, weights)
        with context.stage("quantize", message=failure):
            result, record = quantize_backend_model(quantizer, result, sample_inputs, self.export_format, program)
        return result, record
