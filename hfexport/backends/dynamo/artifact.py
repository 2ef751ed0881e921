"""How a Dynamo component is saved (`torch.export.save`: a `.pt2` zip whose parts deserialise with pickle)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hfexport.artifacts.formats import ArtifactFormat, Signature, check_zip_archive
from hfexport.naming import signature_names


def _write_dynamo(program: Any, main: Path, config: Any) -> None:
    import torch

    # A file object, not the path: torch's archive writer takes a path through C++ as UTF-8, and a path that is
    # not (bytes from the file system, Python's surrogate escapes) aborts the whole process (exit 134, torch 2.13).
    with open(main, "wb") as file:
        torch.export.save(program, file)


def _dynamo_signature(program: Any) -> Signature:
    names = signature_names(program)
    return names if names is not None else ([], [])


ARTIFACT = ArtifactFormat(
    "dynamo",
    _write_dynamo,
    _dynamo_signature,
    trust="holds a torch .pt2 (torch.export.save), whose parts deserialise with pickle: loading one can run code",
    check_saved=check_zip_archive,
)
