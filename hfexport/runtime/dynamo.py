"""Load a saved `ExportedProgram` (`.pt2`) whose inputs or outputs hold transformers objects."""

from __future__ import annotations

from pathlib import Path

import torch


def load_program(path: str | Path) -> torch.export.ExportedProgram:
    """`torch.export.load` after registering what a transformers export needs to deserialise.

    A program's pytree specs name transformers classes (model outputs, caches); a fresh process knows
    them only once they are imported and, for caches, registered as pytree nodes.
    """
    from hfexport.cache_pytree import register_program_types

    register_program_types()
    return torch.export.load(str(path))
