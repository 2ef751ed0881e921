"""HfExporter and the exporters: capture (frontend) + lowering (per backend), with a report each call."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from hfexport.configs import (
    DynamoConfig,
    ExecutorchConfig,
    ExportConfigMixin,
    ExportFormat,
    OnnxConfig,
    OpenVINOConfig,
)
from hfexport.errors import ConfigError, HfExportError, InputError, MissingPackageError, OutputPathError
from hfexport.files import save_atomically
from hfexport.report import ExportReport
from hfexport.rewrites.rule import RuleSelection
from hfexport.versions import check_packages

logger = logging.getLogger("hfexport")

# One export at a time per process (docs/reliability.md, "Concurrency"). torch.export itself is not
# thread-safe: it sets process-wide flags (torch.compiler.is_exporting), registers pytree nodes and patches
# dispatch tables while it traces, and the export switches the model's own state (eval mode, attention
# implementation) for the trace. Exports in other threads wait here; an eager forward in another thread does
# not wait and never sees a patch (patches are bound per instance and thread, or dispatch on a ContextVar).
# Reentrant: export_for_generation holds it across its components' exports.
EXPORT_LOCK = threading.RLock()

# Raised as they are: they say what to fix in the call, and are raised before the model is touched.
_API_ERRORS = (InputError, ConfigError, MissingPackageError, HfExportError)


class HfExporter(ABC):
    """Base of every exporter: environment checks, config checks, the export report.

    Subclasses set `export_format`, `config_class`, the package attributes, and implement `export`.
    """

    export_format: ClassVar[str] = ""
    config_class: ClassVar[type[ExportConfigMixin]] = ExportConfigMixin
    required_packages: ClassVar[tuple[str, ...]] = ("torch", "transformers")
    min_versions: ClassVar[dict[str, str]] = {"torch": "2.9.0", "transformers": "5.0.0"}
    tested_versions: ClassVar[dict[str, str]] = {"torch": "2.13.0", "transformers": "5.24.0"}

    def __init__(self) -> None:
        self.report: ExportReport | None = None

    def validate_environment(self) -> dict[str, str]:
        """Raise `MissingPackageError` for missing/too-old packages; warn once on drift from tested."""
        return check_packages(self.required_packages, self.min_versions, self.tested_versions, who=type(self).__name__)

    def check_config(self, config: ExportConfigMixin | None) -> ExportConfigMixin:
        if config is None:
            return self.config_class()
        # The config classes subclass DynamoConfig: an OnnxConfig is a DynamoConfig, but its ONNX options would be
        # silently ignored by the DynamoExporter, so the format must match too.
        if not isinstance(config, self.config_class) or str(config.export_format) != str(self.export_format):
            raise ConfigError(
                f"{type(self).__name__} takes a {self.config_class.__name__}, got {type(config).__name__}; "
                "AutoHfExporter.from_config(config) picks the exporter that fits a config"
            )
        return config

    @abstractmethod
    def export(
        self, model: torch.nn.Module, sample_inputs: Mapping[str, Any], config: ExportConfigMixin | None = None
    ) -> Any:
        """Export `model`, traced on `sample_inputs` (its forward kwargs); return the backend's native object."""

    def export_for_generation(
        self,
        model: torch.nn.Module,
        generate_kwargs: Mapping[str, Any],
        config: ExportConfigMixin | Mapping[str, ExportConfigMixin] | None = None,
        *,
        generation_config: Any = None,
        multi_token_decode: bool = False,
    ) -> dict[str, Any]:
        """Export every component `generate` runs (see `decompose_for_generation`): `{name: native object}`.

        `config` is one config for all components or a dict keyed by component name that names every one.
        `self.reports` holds each component's report (`self.report` is the last one's).
        """
        if isinstance(config, Mapping):
            for each in config.values():
                self.check_config(each)
        else:
            self.check_config(config)
        check_generation_call(model, generate_kwargs, generation_config)
        self.validate_environment()
        with EXPORT_LOCK:
            return self._export_components(model, generate_kwargs, config, generation_config, multi_token_decode)

    def _export_components(
        self,
        model: torch.nn.Module,
        generate_kwargs: Mapping[str, Any],
        config: ExportConfigMixin | Mapping[str, ExportConfigMixin] | None,
        generation_config: Any,
        multi_token_decode: bool,
    ) -> dict[str, Any]:
        from hfexport.frontends.generation import (
            GenerationComponents,
            decompose_for_generation,
            describe,
            specialise_layouts,
            split_config,
        )

        components = decompose_for_generation(
            model, generate_kwargs, generation_config=generation_config, multi_token_decode=multi_token_decode
        )
        configs = split_config(config, list(components))
        configs = self._calibrate_components(model, config, configs, generation_config, multi_token_decode)
        components, layouts = specialise_layouts(components)
        results = GenerationComponents()
        results.spec = describe(components, generation_config, model, multi_token_decode, generate_kwargs)
        for name, layout in layouts.items():
            results.spec.components[name].layout = layout
        results.samples = {name: kwargs for name, (_, kwargs) in components.items()}
        self.reports: dict[str, ExportReport] = {}
        for name, (submodule, kwargs) in components.items():
            logger.info("exporting component %s (%s)", name, type(submodule).__name__)
            self.report = None
            try:
                results[name] = self.export(submodule, kwargs, configs[name])
            except Exception as exc:
                raise HfExportError(
                    f"{type(exc).__name__}: {exc}",
                    stage=getattr(exc, "stage", "export"),
                    rule_id=getattr(exc, "rule_id", None),
                    model=f"component {name!r} ({type(submodule).__name__}, inputs {sorted(kwargs)})",
                ) from exc
            finally:
                if self.report is not None:
                    self.report.component = name
                    self.reports[name] = self.report
        return results

    def _calibrate_components(
        self,
        model: torch.nn.Module,
        config: Any,
        configs: dict[str, Any],
        generation_config: Any,
        multi_token_decode: bool,
    ) -> dict[str, Any]:
        """Per-component quantizer calibration: a single config's dataset holds generate kwargs, and each component
        calibrates on the forward kwargs recorded for it (a `{component: config}` dict is used as it is)."""
        from hfexport.quantizers.apply import check_quantizer
        from hfexport.quantizers.generation import calibrate_components

        # Every component's quantizer is checked before the first component is traced.
        for each in configs.values():
            if getattr(each, "quantizer", None) is not None:
                check_quantizer(each.quantizer, self.export_format, each)
        return calibrate_components(
            model, config, configs, generation_config=generation_config, multi_token_decode=multi_token_decode
        )


def effective_selection(config: ExportConfigMixin, quantizer: Any = None) -> RuleSelection:
    """The one rule selection an export runs with: the config's, plus what the quantizer and config switch off.

    A quantizer's `disabled_rules` and `OnnxConfig(fusions=None)` are disabled here, each with its reason, so
    the engine has one place that decides whether a rule runs and the report says why one did not.
    """
    from hfexport.rewrites.engine import default_registry

    selection = config.rules
    if quantizer is not None and quantizer.disabled_rules:
        selection = selection.with_disabled(
            quantizer.disabled_rules, f"{type(quantizer).__name__} cannot work with this rule's output"
        )
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


class DynamoExporter(HfExporter):
    """Export to a `torch.export.ExportedProgram` (run with `.module()(**inputs)`, AOTInductor, ...)."""

    export_format: ClassVar[str] = ExportFormat.DYNAMO.value
    config_class: ClassVar[type[ExportConfigMixin]] = DynamoConfig

    def export(
        self, model: torch.nn.Module, sample_inputs: Mapping[str, Any], config: ExportConfigMixin | None = None
    ) -> torch.export.ExportedProgram:
        return self._capture_and_lower(model, sample_inputs, config)

    # -- shared pipeline; backends override `capture_options` and `lower` ---------------------------
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

    def lower(self, program: torch.export.ExportedProgram, config: ExportConfigMixin, context: Any) -> Any:
        # torch.export keeps in-place ops (a static cache's index_copy_) in its graph; functionalising turns
        # each write into a USER_INPUT_MUTATION, the form the contract documents and runtimes rely on.
        if _mutates(program):
            with context.stage("lower"):
                program = program.run_decompositions({})
        return program

    def _capture_and_lower(
        self, model: torch.nn.Module, sample_inputs: Mapping[str, Any], config: ExportConfigMixin | None
    ) -> Any:
        from hfexport.frontends.torch_export import capture, check_attention_implementation, validate_inputs
        from hfexport.rewrites.engine import RewriteContext, default_registry

        # Every check that needs no tracing runs first: a bad call fails in milliseconds, the model untouched.
        config = self.check_config(config)
        if not isinstance(model, torch.nn.Module):
            raise InputError(f"model must be a torch.nn.Module (a PreTrainedModel), got {type(model).__name__}")
        validate_inputs(sample_inputs, getattr(config, "dynamic_shapes", None))
        check_attention_implementation(model)
        versions = self.validate_environment()
        default_registry().validate_selection(config.rules)
        output_path = getattr(config, "output_path", None)
        if output_path is not None:
            check_output_path(output_path)
        quantizer = getattr(config, "quantizer", None)
        if quantizer is not None:
            # Before tracing: a quantizer that does not fit the format, or lacks its packages, fails in milliseconds.
            from hfexport.quantizers.apply import check_quantizer

            versions = {**versions, **check_quantizer(quantizer, self.export_format, config)}
            check_calibration_samples(quantizer, sample_inputs)
        # The lowering never writes: the result is saved here, at stage "save", all or nothing.
        unsaved = dataclasses.replace(config, output_path=None) if output_path is not None else config

        context = RewriteContext(backend=self.export_format, selection=effective_selection(config, quantizer))
        warnings: list[str] = []
        quantization = None
        start = time.perf_counter()
        try:
            with EXPORT_LOCK:
                options = self.capture_options(model, sample_inputs, config, warnings)
                program = capture(model, sample_inputs, options, context, warnings)
                if quantizer is None:
                    result = self.lower(program, unsaved, context)
                else:
                    result, quantization = self._quantize_and_lower(
                        quantizer, program, sample_inputs, options, unsaved, context
                    )
                if output_path is not None:
                    context.current_stage = "save"
                    saving = time.perf_counter()
                    self._save_lowered(result, config)
                    context.stage_seconds["save"] = time.perf_counter() - saving
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
                versions=versions,
                quantization=quantization,
            )
        return result

    def _quantize_and_lower(
        self,
        quantizer: Any,
        program: torch.export.ExportedProgram,
        sample_inputs: Mapping[str, Any],
        options: Any,
        config: ExportConfigMixin,
        context: Any,
    ) -> tuple[Any, Any]:
        """Lower with `quantizer` applied: on the FX graph before lowering, or on the backend's model after it
        (the caller saves afterwards, so a saved artifact is the quantized one)."""
        from hfexport.quantizers.apply import quantize_backend_model, quantize_program

        if quantizer.quantizes_fx_graph:
            context.current_stage = "quantize"
            program, record = quantize_program(quantizer, program, sample_inputs, options, self.export_format)
            context.stage_seconds["quantize"] = record.seconds
            return self.lower(program, config, context), record
        result = self.lower(program, config, context)
        context.current_stage = "quantize"
        result, record = quantize_backend_model(quantizer, result, sample_inputs, self.export_format)
        context.stage_seconds["quantize"] = record.seconds
        return result, record

    def _save_lowered(self, result: Any, config: ExportConfigMixin) -> None:
        """Save a lowered (and quantized) model to `config.output_path`: every file complete, or none of them."""
        destination = Path(config.output_path)
        if self.export_format == ExportFormat.ONNX.value:
            save_atomically(destination, lambda path: result.save(path, external_data=config.external_data))
        elif self.export_format == ExportFormat.OPENVINO.value:
            import openvino as ov

            save_atomically(
                destination, lambda path: ov.save_model(result, str(path), compress_to_fp16=config.compress_to_fp16)
            )
        else:
            raise ConfigError(f"{type(self).__name__} has no output_path to save a model to")


# generate kwargs that are model inputs, always tensors (others such as `forced_decoder_ids` may be lists).
_TENSOR_KWARGS = frozenset(
    {
        "input_ids",
        "attention_mask",
        "inputs_embeds",
        "pixel_values",
        "input_features",
        "decoder_input_ids",
        "decoder_attention_mask",
        "token_type_ids",
        "position_ids",
    }
)
# Caches whose tensors live elsewhere (offloaded: moved between devices on CUDA streams) or in a quantized
# store (optimum-quanto/HQQ kernels): none can be an input or output of an exported graph.
_UNEXPORTABLE_CACHE = re.compile(r"offloaded|quantized")


def check_generation_call(model: Any, generate_kwargs: Any, generation_config: Any = None) -> None:
    """Refuse, before `generate` runs, generate kwargs and cache settings that cannot be exported."""
    if not isinstance(generate_kwargs, Mapping) or not generate_kwargs:
        raise InputError("generate_kwargs must be a non-empty mapping, e.g. a tokenizer's BatchEncoding")
    for name, value in generate_kwargs.items():
        if name in _TENSOR_KWARGS and not isinstance(value, (torch.Tensor, type(None))):
            raise InputError(
                f"generate_kwargs[{name!r}] is a {type(value).__name__}, not a tensor; tokenize with "
                "return_tensors='pt' and pass the tensors"
            )
    config = generation_config if generation_config is not None else getattr(model, "generation_config", None)
    cache = getattr(config, "cache_implementation", None)
    if isinstance(cache, str) and _UNEXPORTABLE_CACHE.search(cache):
        raise ConfigError(
            f"cache_implementation={cache!r} cannot be exported (its tensors are offloaded or quantized outside the "
            "graph); use cache_implementation='static' for a fixed-size cache, or None for the dynamic cache"
        )
    max_cache_len = getattr(config, "max_cache_len", None)
    prompt = generate_kwargs.get("input_ids", generate_kwargs.get("inputs_embeds"))
    if isinstance(max_cache_len, int) and isinstance(prompt, torch.Tensor) and prompt.ndim >= 2:
        length = prompt.shape[1]
        if max_cache_len <= length:
            # transformers would silently grow the cache to fit; the export would then not have the asked size.
            raise InputError(
                f"max_cache_len={max_cache_len} leaves no room after the {length}-token prompt; set max_cache_len "
                f"to at least the prompt length plus max_new_tokens (here >= {length + 1}), or leave it None"
            )


def check_calibration_samples(quantizer: Any, sample_inputs: Mapping[str, Any]) -> None:
    """Refuse, before tracing, calibration samples (a list) that lack a tensor input of the export."""
    from hfexport.quantizers.base import CalibrationSet

    dataset = getattr(quantizer, "calibration_dataset", None)
    if isinstance(dataset, (list, tuple, Mapping, torch.Tensor, str)):
        # Its own checks (a single sample, a tensor, ...); only an iterator is not built here, as that would consume it.
        CalibrationSet(dataset, sample_inputs)
    if not isinstance(dataset, (list, tuple)) or not getattr(quantizer, "needs_calibration", True):
        return
    needed = [name for name, value in sample_inputs.items() if isinstance(value, torch.Tensor)]
    for index, sample in enumerate(dataset):
        if not isinstance(sample, Mapping):
            raise InputError(
                f"calibration sample {index} is a {type(sample).__name__}; each sample must be a mapping of forward "
                "argument names to tensors, like sample_inputs"
            )
        missing = [name for name in needed if name not in sample]
        if missing:
            raise InputError(
                f"calibration sample {index} lacks {missing}, tensor inputs of the export (its keys: "
                f"{sorted(map(str, sample))}); give every sample the keys of sample_inputs: {needed}"
            )


def check_output_path(output_path: str | os.PathLike[str]) -> None:
    """Refuse, before tracing, an `output_path` that cannot be written: a folder, or under a file or a read-only
    folder. An existing file is replaced (atomically, when the export succeeds)."""
    path = Path(output_path)
    if path.is_dir():
        raise OutputPathError(
            f"output_path {str(path)!r} is a folder; name the model file in it (e.g. {path}/model...)"
        )
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise OutputPathError(
            f"output_path {str(path)!r} cannot be created: {str(parent)!r} is a file, not a folder; choose another path"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputPathError(f"output_path {str(path)!r} cannot be written: no write permission in {str(parent)!r}")


class OnnxExporter(DynamoExporter):
    """Export to a `torch.onnx.ONNXProgram` (callable, `.save("model.onnx")`, run by ONNX Runtime)."""

    export_format: ClassVar[str] = ExportFormat.ONNX.value
    config_class: ClassVar[type[ExportConfigMixin]] = OnnxConfig
    required_packages: ClassVar[tuple[str, ...]] = ("torch", "transformers", "onnx", "onnxscript")
    tested_versions: ClassVar[dict[str, str]] = {
        **HfExporter.tested_versions,
        "onnx": "1.23.2",
        "onnxscript": "0.7.2",
        "onnx-ir": "1.1.0",
        "onnxruntime": "1.32.0",
    }

    def export(
        self, model: torch.nn.Module, sample_inputs: Mapping[str, Any], config: ExportConfigMixin | None = None
    ) -> Any:
        return self._capture_and_lower(model, sample_inputs, config)

    def lower(self, program: torch.export.ExportedProgram, config: ExportConfigMixin, context: Any) -> Any:
        # Imported here: `import hfexport` must not import onnx or onnxscript.
        from hfexport.lowerings.onnx import lower

        assert isinstance(config, OnnxConfig)
        return lower(program, config, context)


class ExecutorchExporter(DynamoExporter):
    """Export to an `executorch.exir.ExecutorchProgramManager` (`.save("model.pte")`, ExecuTorch runtime)."""

    export_format: ClassVar[str] = ExportFormat.EXECUTORCH.value
    config_class: ClassVar[type[ExportConfigMixin]] = ExecutorchConfig
    required_packages: ClassVar[tuple[str, ...]] = ("torch", "transformers", "executorch")
    tested_versions: ClassVar[dict[str, str]] = {**HfExporter.tested_versions, "executorch": "1.4.1"}

    def export(
        self, model: torch.nn.Module, sample_inputs: Mapping[str, Any], config: ExportConfigMixin | None = None
    ) -> Any:
        config = self.check_config(config)
        assert isinstance(config, ExecutorchConfig)
        from hfexport.lowerings.executorch import check_backend

        check_backend(config)  # before tracing: a missing CUDA device fails in milliseconds, not minutes
        return self._capture_and_lower(model, sample_inputs, config)

    def capture_options(
        self, model: torch.nn.Module, sample_inputs: Mapping[str, Any], config: ExportConfigMixin, warnings: list[str]
    ) -> Any:
        # Memory planning needs an upper bound on every dynamic axis: unbounded ones are capped (one warning).
        from hfexport.lowerings.executorch import capture_options

        assert isinstance(config, ExecutorchConfig)
        return capture_options(model, sample_inputs, config, warnings)

    def lower(self, program: torch.export.ExportedProgram, config: ExportConfigMixin, context: Any) -> Any:
        from hfexport.lowerings.executorch import lower

        assert isinstance(config, ExecutorchConfig)
        return lower(program, config, context)


class OpenVINOExporter(DynamoExporter):
    """Export to an `openvino.Model` (compile with `openvino.Core().compile_model(model, "CPU")`)."""

    export_format: ClassVar[str] = ExportFormat.OPENVINO.value
    config_class: ClassVar[type[ExportConfigMixin]] = OpenVINOConfig
    required_packages: ClassVar[tuple[str, ...]] = ("torch", "transformers", "openvino")
    tested_versions: ClassVar[dict[str, str]] = {**HfExporter.tested_versions, "openvino": "2026.4.1"}

    def export(
        self, model: torch.nn.Module, sample_inputs: Mapping[str, Any], config: ExportConfigMixin | None = None
    ) -> Any:
        return self._capture_and_lower(model, sample_inputs, config)

    def lower(self, program: torch.export.ExportedProgram, config: ExportConfigMixin, context: Any) -> Any:
        from hfexport.lowerings.openvino import lower

        assert isinstance(config, OpenVINOConfig)
        return lower(program, config, context)
