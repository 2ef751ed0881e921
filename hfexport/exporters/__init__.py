"""The exporters: one pipeline (`pipeline.py`), the checks before it (`preflight.py`), one module per format."""

from hfexport.exporters.base import EXPORT_LOCK, HfExporter
from hfexport.exporters.dynamo import DynamoExporter
from hfexport.exporters.executorch import ExecutorchExporter
from hfexport.exporters.onnx import OnnxExporter
from hfexport.exporters.openvino import OpenVINOExporter
from hfexport.exporters.pipeline import CaptureExporter, effective_selection
from hfexport.exporters.preflight import (
    check_calibration_samples,
    check_generation_call,
    check_output_path,
    preflight,
)
from hfexport.files import save_atomically

__all__ = [
    "EXPORT_LOCK",
    "CaptureExporter",
    "DynamoExporter",
    "ExecutorchExporter",
    "HfExporter",
    "OnnxExporter",
    "OpenVINOExporter",
    "check_calibration_samples",
    "check_generation_call",
    "check_output_path",
    "effective_selection",
    "preflight",
    "save_atomically",
]
