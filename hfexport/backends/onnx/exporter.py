"""`OnnxExporter`: `torch.onnx.ONNXProgram`, saved atomically when `output_path` is set."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

import torch

from hfexport.backends.dynamo.exporter import DynamoExporter
from hfexport.backends.onnx.config import OnnxConfig
from hfexport.configs import ExportConfigMixin
from hfexport.core.files import save_atomically
from hfexport.exporters.base import HfExporter
from hfexport.exporters.pipeline import Lowering


class OnnxLowering(Lowering):
    streams_weights: ClassVar[bool] = True

    def lower(
        self, program: torch.export.ExportedProgram, config: ExportConfigMixin, context: Any, weights: Any
    ) -> Any:
        # Imported here: `import hfexport` must not import onnx or onnxscript.
        from hfexport.lowerings.onnx import lower

        assert isinstance(config, OnnxConfig)
        return lower(program, config, context, weights=weights)

    def finish(self, result: Any, config: ExportConfigMixin, context: Any, notes: list[str]) -> Any:
        from hfexport.lowerings.onnx import rewrite_quantized

        rewrite_quantized(result, context)
        return result

    def used(self, result: Any, config: ExportConfigMixin, context: Any) -> dict[str, Any]:
        # Read from the IR, not `model_proto`: serialising would read every (streamed) weight into memory.
        model = result.model
        opsets = {domain or "ai.onnx": version for domain, version in model.opset_imports.items()}
        fused = sorted(
            rule_id
            for rule_id, outcome in context.outcomes.items()
            if outcome.stage == "onnx" and outcome.kind == "optimization" and outcome.hits
        )
        initializer_types = Counter(
            int(v.const_value.dtype) for v in model.graph.initializers.values() if v.const_value is not None
        )
        used: dict[str, Any] = {"opset": opsets.get("ai.onnx"), "fusions": fused or "none"}
        if "com.microsoft" in opsets:
            used["contrib_ops"] = "com.microsoft (ONNX Runtime only; --portable for standard ops)"
        if initializer_types:
            import onnx

            used["weights"] = onnx.helper.tensor_dtype_to_np_dtype(initializer_types.most_common(1)[0][0]).name
        return used

    def save(self, result: Any, config: ExportConfigMixin) -> None:
        assert isinstance(config, OnnxConfig)
        # The graph names its .data file: the pair is replaced as one (never the old graph with new weights).
        save_atomically(
            Path(config.output_path),
            lambda path: result.save(path, external_data=config.external_data),
            side_files_named_by_main=True,
        )


class OnnxExporter(DynamoExporter):
    """Export to a `torch.onnx.ONNXProgram` (callable, `.save("model.onnx")`, run by ONNX Runtime)."""

    export_format: ClassVar[str] = "onnx"
    config_class: ClassVar[type[ExportConfigMixin]] = OnnxConfig
    required_packages: ClassVar[tuple[str, ...]] = ("torch", "transformers", "onnx", "onnxscript")
    tested_versions: ClassVar[dict[str, str]] = {
        **HfExporter.tested_versions,
        "onnx": "1.23.2",
        "onnxscript": "0.7.2",
        "onnx-ir": "1.1.0",
        "onnxruntime": "1.32.0",
    }
    lowering: ClassVar[Lowering] = OnnxLowering()
