"""The feeds a quantizer maps calibration samples through, under the module path the docs' recipe names."""

from __future__ import annotations

from hfexport.naming import onnx_feed, openvino_feed
from hfexport.quantizers.base import CalibrationSet, traced_inputs

__all__ = ["CalibrationSet", "onnx_feed", "openvino_feed", "traced_inputs"]
