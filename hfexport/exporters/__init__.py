"""The exporters: one pipeline (`pipeline.py`), the checks before it (`preflight.py`), generation components
(`generation.py`); each backend's exporter class is in its folder (`hfexport/backends/<name>/exporter.py`).

The backends' exporter classes are names of this package too (`hfexport.exporters.OnnxExporter`), looked up in
the descriptors on first use.
"""

from hfexport.backends.registry import lazy_classes
from hfexport.core.files import save_atomically
from hfexport.exporters.base import EXPORT_LOCK, HfExporter
from hfexport.exporters.pipeline import CaptureExporter, Lowering, effective_selection
from hfexport.exporters.preflight import (
    check_calibration_samples,
    check_generation_call,
    check_output_path,
    preflight,
)

__all__ = [
    "EXPORT_LOCK",
    "CaptureExporter",
    "HfExporter",
    "Lowering",
    "check_calibration_samples",
    "check_generation_call",
    "check_output_path",
    "effective_selection",
    "preflight",
    "save_atomically",
]


# The backends' exporter classes by name, imported from their folders on first use.
__getattr__ = lazy_classes(__name__, "exporter")
