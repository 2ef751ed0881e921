"""HfExporter and the exporters: capture (frontend) + lowering (per backend), with a report each call."""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
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
from hfexport.errors import ConfigError, InputError
from hfexport.report import ExportReport
from hfexport.versions import check_packages

logger = logging.getLogger("hfexport")


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
        if not isinstance(config, self.config_class):
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
        return program

    def _capture_and_lower(
        self, model: torch.nn.Module, sample_inputs: Mapping[str, Any], config: ExportConfigMixin | None
    ) -> Any:
        from hfexport.frontends.torch_export import capture, validate_inputs
        from hfexport.rewrites.engine import RewriteContext, default_registry

        config = self.check_config(config)
        if not isinstance(model, torch.nn.Module):
            raise InputError(f"model must be a torch.nn.Module (a PreTrainedModel), got {type(model).__name__}")
        validate_inputs(sample_inputs, getattr(config, "dynamic_shapes", None))
        versions = self.validate_environment()
        default_registry().validate_selection(config.rules)

        context = RewriteContext(backend=self.export_format, selection=config.rules)
        warnings: list[str] = []
        start = time.perf_counter()
        try:
            options = self.capture_options(model, sample_inputs, config, warnings)
            program = capture(model, sample_inputs, options, context, warnings)
            result = self.lower(program, config, context)
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
            )
        return result


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
