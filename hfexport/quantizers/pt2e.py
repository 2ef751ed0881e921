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

logger = logging.getLogger("hfexport")


class PT2EQuantizer(ExportQuantizer):
    """Quantize the captured FX graph with a PT2E quantizer; every backend receives the quantized graph.

    pt2e_quantizer: a `torchao.quantization.pt2e.quantizer.Quantizer`, e.g.
        `X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())` or ExecuTorch's
        `XNNPACKQuantizer().set_global(get_symmetric_quantization_config())`.
    calibration_dataset: forward kwargs to observe activation ranges on (see `CalibrationSet`).
    """

    quantizes_fx_graph: ClassVar[bool] = True
    supported_formats: ClassVar[tuple[ExportFormat, ...]] = (
        ExportFormat.DYNAMO,
        ExportFormat.ONNX,
        ExportFormat.EXECUTORCH,
        ExportFormat.OPENVINO,
    )
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
        if str(export_format) == ExportFormat.EXECUTORCH.value and kind == "X86InductorQuantizer":
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

        prepared = prepare_pt2e(model, _keeping_integer_constants(self.pt2e_quantizer))
        calibration = self.calibration(sample_inputs, lambda sample: traced_inputs(sample, sample_inputs))
        with torch.no_grad():
            for inputs in calibration:
                prepared(**inputs)
        # OpenVINO reads a quantize/dequantize pair on a float weight as FakeQuantize and compresses the weight
        # itself; a weight folded to int8 ahead of it leaves a `linear` its converter rejects.
        fold = str(export_format) != ExportFormat.OPENVINO.value
        return convert_pt2e(prepared, fold_quantize=fold)


_ARITHMETIC = ("add.Tensor", "sub.Tensor", "mul.Tensor")


def restore_integer_constants(model: torch.fx.GraphModule) -> int:
    """Give back their integer dtype to scalar constants of integer arithmetic; return how many were changed.

    ExecuTorch's XNNPACKQuantizer turns scalar operands into float tensor attributes before annotating
    (executorch 1.4.1). In the index arithmetic of transformers' mask creation (`arange + offset`) that makes
    the result float, and the calibration run fails ("tensors used as indices must be long, ...").
    """
    changed = 0
    for node in model.graph.nodes:
        if node.op != "call_function" or not str(node.target).endswith(_ARITHMETIC):
            continue
        args = [a for a in node.args if isinstance(a, torch.fx.Node)]
        integers = [a for a in args if getattr(a.meta.get("val"), "dtype", torch.float32) in _INTEGER]
        for arg in args:
            if arg.op != "get_attr" or not integers:
                continue
            value = getattr(model, str(arg.target), None)
            if not isinstance(value, torch.Tensor) or not value.is_floating_point() or value.numel() != 1:
                continue
            dtype = integers[0].meta["val"].dtype
            if value.to(dtype).to(value.dtype).equal(value):
                setattr(model, str(arg.target), value.to(dtype))
                changed += 1
    return changed


_INTEGER = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _keeping_integer_constants(quantizer: Any) -> Any:
    """`quantizer` seen through a delegate whose `transform_for_annotation` also restores integer constants."""
    from torchao.quantization.pt2e.quantizer import Quantizer

    class KeepingIntegerConstants(Quantizer):
        def transform_for_annotation(self, model: torch.fx.GraphModule) -> torch.fx.GraphModule:
            model = quantizer.transform_for_annotation(model)
            if restore_integer_constants(model):
                model.recompile()
            return model

        def annotate(self, model: torch.fx.GraphModule) -> torch.fx.GraphModule:
            return quantizer.annotate(model)

        def validate(self, model: torch.fx.GraphModule) -> None:
            quantizer.validate(model)

        def prepare_obs_or_fq_callback(self, model: torch.fx.GraphModule, edge_or_node_to_obs_or_fq: Any) -> None:
            quantizer.prepare_obs_or_fq_callback(model, edge_or_node_to_obs_or_fq)

    return KeepingIntegerConstants()
