"""The Dynamo exporter: the captured `ExportedProgram` itself."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from hfexport.configs import DynamoConfig, ExportConfigMixin
from hfexport.exporters.pipeline import CaptureExporter
from hfexport.formats import ExportFormat


class DynamoExporter(CaptureExporter):
    """Export to a `torch.export.ExportedProgram` (run with `.module()(**inputs)`, AOTInductor, ...)."""

    export_format: ClassVar[str] = ExportFormat.DYNAMO.value
    config_class: ClassVar[type[ExportConfigMixin]] = DynamoConfig

    def export(
        self, model: torch.nn.Module, sample_inputs: Mapping[str, Any], config: ExportConfigMixin | None = None
    ) -> torch.export.ExportedProgram:
        return self._capture_and_lower(model, sample_inputs, config)
