"""Third-party noise the command hides unless `--debug`: messages that say nothing about the user's export.

Each filter names one message seen on runs of the commands (torch 2.13, torchao 0.17, transformers 5.24,
onnx-ir 0.2); anything else, warnings from hfexport itself included, still shows.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings

# Loggers whose warnings are about the installed wheels, not the export: torchao cannot load its CUDA/mxfp8
# kernels on a CPU machine; torch's pytree deprecates register_constant on Enum types that torchao registers.
_QUIET_LOGGERS = ("torchao", "torch.utils._pytree")
# (logger, start of the message) of single records that repeat what hfexport says itself, or report a
# choice of the installed wheels:
_QUIET_RECORDS = (
    # torch.onnx registers torchvision's ops when torchvision is there; it is not a dependency (4 lines a run).
    ("torch.onnx._internal.exporter._registration", "torchvision is not installed"),
    # A size-1 sample axis made static: hfexport's own warning says so, with what to do.
    ("torch._export.non_strict_utils", "dimension "),
    # torch.export.load of a program whose unbacked symbols the graph no longer holds: nothing to act on.
    ("torch._export.serde.serialize", "Symbol %s did not appear"),
    # A failed trace: which user code the unbacked symbol came from (the error names the line itself).
    ("torch.fx.experimental.symbolic_shapes", "Unable to find user code corresponding to"),
    # onnx-ir types an empty attribute list as INTS, which is what the ONNX exporter means by it.
    ("onnx_ir._convenience", "Attribute type is ambiguous because it is an empty sequence"),
)
# (category, message regex): torch's deprecation of its own LeafSpec check, raised from inside torch (copyreg)
# whenever a program is copied.
_QUIET_WARNINGS = ((FutureWarning, r".*isinstance\(treespec, LeafSpec\)"),)


class _DropRecord(logging.Filter):
    def __init__(self, prefix: str) -> None:
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def quiet_third_party(debug: bool) -> None:
    """Silence the known third-party noise for this process (nothing when `debug`)."""
    if debug:
        return
    if not sys.stderr.isatty():
        # transformers' "Loading weights: 100%|███| 36/36" bar, redrawn with carriage returns: in a log or a pipe it is
        # one line of noise per model load. Read when transformers is first imported, which happens after this.
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for name, prefix in _QUIET_RECORDS:
        logging.getLogger(name).addFilter(_DropRecord(prefix))
    for category, pattern in _QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category)
