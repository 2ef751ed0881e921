"""`PT2EQuantizer`: PyTorch 2 Export quantization (torchao's prepare_pt2e -> calibrate -> convert_pt2e).

It wraps a PT2E `Quantizer` object, which decides where quantize/dequantize pairs go and so which runtime
can use the result: torchao's `X86InductorQuantizer` for PyTorch/inductor, ONNX Runtime (QDQ) and OpenVINO
(FakeQuantize), ExecuTorch's `XNNPACKQuantizer` for ExecuTorch's XNNPACK delegate.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch

from hfexport.errors import ConfigError
from hfexport.formats import ExportFormat
from hfexport.quantizers.base import ExportQuantizer, traced_inputs
from hfexport.rewrites.rules.executorch._pt2e import (
    keeping_integer_constants,
)

logger = logging.getLogger("hfexport")


class PT2EQuantizer(ExportQuantizer):
    """Quantize the captured FX graph with a PT2E quantizer; every backend receives the quantized graph.

    pt2e_quantizer: a `torchao.quantization.pt2e.quantizer.Quantizer`, e.g.
        `X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())` or ExecuTorch's
        `XNNPACKQuantizer().set_global(get_symmetric_quantization_config())`.
    calibration_dataset: forward kwargs to observe activation ranges on (see `CalibrationSet`).
    """

    quantizes_fx_graph: ClassVar[bool] = True
    # Every format: each starts from the captured FX graph.
    supported_formats: ClassVar[tuple[ExportFormat, ...]] = tuple(ExportFormat)
    # XNNPACK's formats: it delegates only the patterns of its own XNNPACKQuantizer.
    xnnpack_formats: ClassVar[tuple[ExportFormat, ...]] = (ExportFormat.EXECUTORCH,)
    # OpenVINO reads a quantize/dequantize pair on a float weight as FakeQuantize and compresses the weight itself;
    # a weight folded to int8 ahead of it leaves a `linear` its converter rejects.
    float_weight_formats: ClassVar[tuple[ExportFormat, ...]] = (ExportFormat.OPENVINO,)
    required_packages: ClassVar[tuple[str, ...]] = ("torchao",)
    min_versions: ClassVar[dict[str, str]] = {"torchao": "0.13.0"}
    tested_versions: ClassVar[dict[str, str]] = {"torchao": "0.18.0"}

    def __init__(self, pt2e_quantizer: Any, calibration_dataset: Iterable[Mapping[str, Any]] | None = None) -> None:
        super().__init__(calibration_dataset)
        if pt2e_quantizer is None or not callable(getattr(pt2e_quantizer, "annotate", None)):
            raise ConfigError(
                "PT2EQuantizer wraps a PT2E quantizer object (one with annotate(), e.g. torchao's "
                f"X86InductorQuantizer or ExecuTorch's XNNPACKQuantizer), got {type(pt2e_quantizer).__name__}"
            )
        self.pt2e_quantizer = pt2e_quantizer

    def check_format(self, export_format: str | ExportFormat) -> None:
        super().check_format(export_format)
        kind = type(self.pt2e_quantizer).__name__
        if str(export_format) in map(str, self.xnnpack_formats) and kind == "X86InductorQuantizer":
            logger.warning(
                "PT2EQuantizer(X86InductorQuantizer) on ExecuTorch: XNNPACK delegates only the patterns of its own "
                "XNNPACKQuantizer; the rest runs as portable (slow) quantized ops"
            )

    def settings(self) -> dict[str, Any]:
        return {"pt2e_quantizer": type(self.pt2e_quantizer).__name__}

    def quantize(
        self, model: torch.fx.GraphModule, sample_inputs: Mapping[str, Any], export_format: str | ExportFormat
    ) -> torch.fx.GraphModule:
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

        prepared = prepare_pt2e(model, keeping_integer_constants(self.pt2e_quantizer))
        calibration = self.calibration(sample_inputs, lambda sample: traced_inputs(sample, sample_inputs))
        with torch.no_grad():
            for inputs in calibration:
                prepared(**inputs)
        fold = str(export_format) not in map(str, self.float_weight_formats)
        return convert_pt2e(prepared, fold_quantize=fold)
