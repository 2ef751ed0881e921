"""Load a saved `ExportedProgram` (`.pt2`) whose inputs or outputs hold transformers objects."""

from __future__ import annotations

from pathlib import Path

import torch


def load_program(path: str | Path) -> torch.export.ExportedProgram:
    """`torch.export.load` after registering what a transformers export needs to deserialise.

    A program's pytree specs name transformers classes (model outputs, caches); a fresh process knows
    them only once they are imported and, for caches, registered as pytree nodes.
    """
    from hfexport.cache_pytree import cache_module_classes, register_program_types

    register_program_types()
    # The example inputs saved in the archive hold transformers' cache objects. torch loads them with the
    # weights-only unpickler first; without these classes on its allow-list that fails, torch falls back to
    # the full unpickler and logs the failure with a broken format string ("--- Logging error ---"). With
    # them the weights-only load succeeds: no fallback, no noise, nothing else allowed.
    with torch.serialization.safe_globals(list(cache_module_classes())):
        return torch.export.load(str(path))
