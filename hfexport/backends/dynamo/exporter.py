"""`DynamoExporter`: the captured `ExportedProgram` itself (the pipeline's default `Lowering`)."""

from __future__ import annotations

from typing import ClassVar

from hfexport.backends.dynamo.config import DynamoConfig
from hfexport.configs import ExportConfigMixin
from hfexport.exporters.pipeline import CaptureExporter


class DynamoExporter(CaptureExporter):
    """Export to a `torch.export.ExportedProgram` (run with `.module()(**inputs)`, AOTInductor, ...).

    Every capture exporter is a `DynamoExporter` by name (each starts from the same capture); what an exporter does
    differently is its `lowering` alone.
    """

    export_format: ClassVar[str] = "dynamo"
    config_class: ClassVar[type[ExportConfigMixin]] = DynamoConfig
