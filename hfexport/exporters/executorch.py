"""The ExecuTorch exporter: `ExecutorchProgramManager` (XNNPACK or CUDA)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from hfexport.configs import ExecutorchConfig, ExportConfigMixin
from hfexport.exporters.base import HfExporter
from hfexport.exporters.dynamo import DynamoExporter
from hfexport.formats import ExportFormat


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

    def used(self, result: Any, config: ExportConfigMixin, context: Any) -> dict[str, Any]:
        return {"backend": getattr(config, "backend", "xnnpack")}

    def lower(self, program: torch.export.ExportedProgram, config: ExportConfigMixin, context: Any) -> Any:
        from hfexport.lowerings.executorch import lower

        assert isinstance(config, ExecutorchConfig)
        return lower(program, config, context)
