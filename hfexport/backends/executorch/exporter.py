"""`ExecutorchExporter`: `ExecutorchProgramManager` (XNNPACK or CUDA)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from hfexport.backends.dynamo.exporter import DynamoExporter
from hfexport.backends.executorch.config import ExecutorchConfig
from hfexport.configs import ExportConfigMixin
from hfexport.exporters.base import HfExporter
from hfexport.exporters.pipeline import Lowering


class ExecutorchLowering(Lowering):
    def check(self, config: ExportConfigMixin) -> None:
        from hfexport.lowerings.executorch import check_backend

        assert isinstance(config, ExecutorchConfig)
        check_backend(config)  # before tracing: a missing CUDA device fails in milliseconds, not minutes

    def capture_options(
        self, model: torch.nn.Module, sample_inputs: Mapping[str, Any], config: ExportConfigMixin, warnings: list[str]
    ) -> Any:
        # Memory planning needs an upper bound on every dynamic axis: unbounded ones are capped (one warning).
        from hfexport.lowerings.executorch import capture_options

        assert isinstance(config, ExecutorchConfig)
        return capture_options(model, sample_inputs, config, warnings)

    def lower(
        self, program: torch.export.ExportedProgram, config: ExportConfigMixin, context: Any, weights: Any
    ) -> Any:
        from hfexport.lowerings.executorch import lower

        assert isinstance(config, ExecutorchConfig)
        return lower(program, config, context)

    def used(self, result: Any, config: ExportConfigMixin, context: Any) -> dict[str, Any]:
        return {"backend": getattr(config, "backend", "xnnpack")}


class ExecutorchExporter(DynamoExporter):
    """Export to an `executorch.exir.ExecutorchProgramManager` (`.save("model.pte")`, ExecuTorch runtime)."""

    export_format: ClassVar[str] = "executorch"
    config_class: ClassVar[type[ExportConfigMixin]] = ExecutorchConfig
    required_packages: ClassVar[tuple[str, ...]] = ("torch", "transformers", "executorch")
    tested_versions: ClassVar[dict[str, str]] = {**HfExporter.tested_versions, "executorch": "1.4.1"}
    lowering: ClassVar[Lowering] = ExecutorchLowering()
