"""The ONNX exporter: `torch.onnx.ONNXProgram`, saved atomically when `output_path` is set."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import torch

from hfexport.configs import ExportConfigMixin, OnnxConfig
from hfexport.exporters.base import HfExporter
from hfexport.exporters.dynamo import DynamoExporter
from hfexport.files import save_atomically
from hfexport.formats import ExportFormat


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

    def save_lowered(self, result: Any, config: ExportConfigMixin) -> None:
        assert isinstance(config, OnnxConfig)
        # The graph names its .data file: the pair is replaced as one (never the old graph with new weights).
        save_atomically(
            Path(config.output_path),
            lambda path: result.save(path, external_data=config.external_data),
            side_files_named_by_main=True,
        )
