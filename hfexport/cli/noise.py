"""Third-party noise the command hides unless `--debug`: messages that say nothing about the user's export.

Each filter names one message seen on every run of a command that builds a model (torch 2.13, torchao 0.17,
transformers 5.24); anything else, warnings from hfexport itself included, still shows.
"""

from __future__ import annotations

import logging
import warnings

# Loggers whose warnings are about the installed wheels, not the export: torchao cannot load its CUDA/mxfp8
# kernels on a CPU machine; torch's pytree deprecates register_constant on Enum types that torchao registers.
_QUIET_LOGGERS = ("torchao", "torch.utils._pytree")
# (category, message regex): torch's deprecation of its own LeafSpec check, raised from inside torch (copyreg)
# whenever a program is copied.
_QUIET_WARNINGS = ((FutureWarning, r".*isinstance\(treespec, LeafSpec\)"),)


def quiet_third_party(debug: bool) -> None:
    """Silence the known third-party noise for this process (nothing when `debug`)."""
    if debug:
        return
    for name in _QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
    for category, pattern in _QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category)
