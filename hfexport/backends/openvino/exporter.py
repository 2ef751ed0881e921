"""`OpenVINOExporter`: `openvino.Model`, saved atomically as IR when `output_path` is set."""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch

from hfexport.backends.dynamo.exporter import DynamoExporter
from hfexport.backends.openvino.config import OpenVINOConfig
from hfexport.configs import ExportConfigMixin
from hfexport.core.files import save_atomically
from hfexport.exporters.base import HfExporter
from hfexport.exporters.pipeline import Lowering


class OpenVINOLowering(Lowering):
    streams_weights: ClassVar[bool] = True

    def lower(
        self, program: torch.export.ExportedProgram, config: ExportConfigMixin, context: Any, weights: Any
    ) -> Any:
        from hfexport.lowerings.openvino import lower

        assert isinstance(config, OpenVINOConfig)
        return lower(program, config, context, weights=weights)

    def finish(self, result: Any, config: ExportConfigMixin, context: Any, notes: list[str]) -> Any:
        # After any quantizer: NNCF calibrates by feeding the cache as inputs, which a stateful model has not.
        if getattr(config, "stateful", False):
            from hfexport.lowerings.openvino import make_stateful

            with context.stage("stateful"):
                if make_stateful(result) == 0:
                    notes.append("stateful=True: the model has no cache input/output pair; it stays stateless")
        return result

    def used(self, result: Any, config: ExportConfigMixin, context: Any) -> dict[str, Any]:
        # What a save writes, by `output_path` or `hfexport.save` alike (both follow compress_to_fp16).
        used = {"saved_weights": "float16" if getattr(config, "compress_to_fp16", False) else "as computed"}
        if getattr(config, "low_memory", False):
            used["weights"] = "streamed from the checkpoint when saved (the openvino.Model holds placeholders)"
        if getattr(config, "stateful", False):
            used["stateful"] = f"{len(result.get_variables())} cache variable(s) in the infer request"
        return used

    def save(self, result: Any, config: ExportConfigMixin) -> None:
        from hfexport.lowerings.openvino_weights import save_ir

        assert isinstance(config, OpenVINOConfig)
        save_atomically(Path(config.output_path), lambda path: save_ir(result, path, config.compress_to_fp16))


class OpenVINOExporter(DynamoExporter):
    """Export to an `openvino.Model` (compile with `openvino.Core().compile_model(model, "CPU")`)."""

    export_format: ClassVar[str] = "openvino"
    config_class: ClassVar[type[ExportConfigMixin]] = OpenVINOConfig
    required_packages: ClassVar[tuple[str, ...]] = ("torch", "transformers", "openvino")
    tested_versions: ClassVar[dict[str, str]] = {**HfExporter.tested_versions, "openvino": "2026.4.1"}
    lowering: ClassVar[Lowering] = OpenVINOLowering()
