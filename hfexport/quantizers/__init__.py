"""Quantization during export: one quantizer class per toolkit and representation.

`CalibrationSet` and `traced_inputs` are here for quantizers written outside hfexport (the ONNX and OpenVINO
feeds are `hfexport.naming.onnx_feed` and `openvino_feed`). The quantizer classes load lazily, and their toolkits
(torchao, nncf, onnxruntime.quantization) only inside `quantize`.
"""

from __future__ import annotations

from hfexport.core._lazy import lazy_getattr
from hfexport.quantizers.base import CalibrationSet, ExportQuantizer, traced_inputs

_LAZY = {
    "PT2EQuantizer": "hfexport.quantizers.pt2e",
    "NNCFTorchFXQuantizer": "hfexport.quantizers.nncf",
    "NNCFOnnxQuantizer": "hfexport.quantizers.nncf",
    "NNCFOpenVINOQuantizer": "hfexport.quantizers.nncf",
    "NNCFQuantizationConfig": "hfexport.quantizers.nncf",
    "NNCFWeightCompressionConfig": "hfexport.quantizers.nncf",
    "OnnxRuntimeQuantizer": "hfexport.quantizers.onnxruntime",
    "OnnxRuntimeStaticConfig": "hfexport.quantizers.onnxruntime",
    "OnnxRuntimeDynamicConfig": "hfexport.quantizers.onnxruntime",
    "TorchAOQuantizer": "hfexport.quantizers.torchao",
}

__all__ = [  # noqa: RUF022 - the eager names first, then the lazy ones
    "CalibrationSet",
    "ExportQuantizer",
    "traced_inputs",
    "PT2EQuantizer",
    "NNCFTorchFXQuantizer",
    "NNCFOnnxQuantizer",
    "NNCFOpenVINOQuantizer",
    "NNCFQuantizationConfig",
    "NNCFWeightCompressionConfig",
    "OnnxRuntimeQuantizer",
    "OnnxRuntimeStaticConfig",
    "OnnxRuntimeDynamicConfig",
    "TorchAOQuantizer",
]


__getattr__ = lazy_getattr("hfexport.quantizers", _LAZY, globals())
