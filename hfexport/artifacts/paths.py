"""Manifest file paths: what a path may look like before any file it names is touched."""

from __future__ import annotations

import re
from pathlib import PurePosixPath
from typing import Any

from hfexport.artifacts.errors import ManifestError, UnsafePathError


def check_path(path: Any, where: str) -> str:
    """A manifest file path: relative, POSIX, no `.`/`..`/empty parts, no backslash or NUL."""
    if not isinstance(path, str) or not path:
        raise ManifestError(f"{where} must be a non-empty string path, got {path!r}")
    if "\x00" in path or "\\" in path or len(path) > 1024:
        raise UnsafePathError(f"{where} {path!r} has a NUL, a backslash, or is too long")
    pure = PurePosixPath(path)
    if pure.is_absolute() or re.match(r"^[A-Za-z]:", path):
        raise UnsafePathError(f"{where} {path!r} is absolute; manifest paths are relative to the artifact folder")
    if any(part in ("", ".", "..") for part in path.split("/")):
        raise UnsafePathError(f"{where} {path!r} has a '..', '.' or empty part; it must stay inside the folder")
    return path
