"""What an artifact does differently per format: the record each backend gives (`ArtifactFormat`), and lookups.

A backend's `ArtifactFormat` (in `hfexport/backends/<name>/artifact.py`, named by its descriptor) says how a native
object of that format is written (`write`), what its signature is as its runtime names it (`signature`), why loading
one needs `trust=True` (`trust`: its files run code when deserialised), which files must sit beside the main one
(`required_siblings`), what is checked in its files before its runtime opens them (`check_saved`), how the
weights of a low-memory export are checked against the checkpoint (`check_streamed`), and how the components of a
generation artifact are written with each weight stored once (`write_components`, where the format can; `methods`:
one file holding a method per component). The
format of an object is `hfexport.formats.format_of`; running a saved component is the backend's runtime
(`hfexport.runtime.drivers`).
"""

from __future__ import annotations

import os
import stat
import zipfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hfexport.artifacts.errors import ArtifactError, UnsafePathError
from hfexport.backends.registry import backend, names

Signature = tuple[list[str], list[str]]


def no_check(directory: Path, component: dict[str, Any]) -> None:
    return None


@dataclass(frozen=True)
class ArtifactFormat:
    name: str
    # write(program, main file path, config): write the main file and its side files beside it.
    write: Callable[[Any, Path, Any], None]
    # (input names, output names) of a native program, as its runtime names them.
    signature: Callable[[Any], Signature]
    # Why loading a saved component runs code it holds (pickle, compiled native code), so that `load` needs
    # `trust=True`; "" when loading only reads data.
    trust: str = ""
    # Files named like the main one, by suffix, that a component of this format must list: {suffix: what it is}.
    required_siblings: Mapping[str, str] = field(default_factory=dict)
    # {suffix: file name}: a required sibling may be this file in the main file's folder instead, the one the
    # graphs of a generation artifact share (`write_components`).
    shared_siblings: Mapping[str, str] = field(default_factory=dict)
    # Checks of a saved component's files before its runtime opens them (paths the model file itself names).
    check_saved: Callable[[Path, dict[str, Any]], None] = no_check
    # check_streamed(main file, checkpoint, quantized) -> `artifacts.low_memory.StreamedWeights`: the saved weights
    # of a low-memory export against the checkpoint (None where the format cannot stream its weights).
    check_streamed: Callable[[Path, Any, bool], Any] | None = None
    # write_components({name: program}, folder, {name: config}) -> {name: its files, the one to load first}: the
    # distinct programs of a generation artifact written together, each weight once (the graphs then share
    # weight files, or one file holds them all: several components with one main file are its methods, each
    # named by its component); None where the format cannot, or not with these configs (each component is then
    # written into its own subfolder by `write`).
    write_components: Callable[[Mapping[str, Any], Path, Mapping[str, Any]], dict[str, list[Path]] | None] | None = None
    # Whether one main file may hold several programs, run by name (the manifest's `method` of a component).
    methods: bool = False


def artifact_format(export_format: str) -> ArtifactFormat:
    """The `ArtifactFormat` of a format name (its backend's, imported on first use)."""
    found: ArtifactFormat = backend(export_format).artifact.load()
    return found


class _ArtifactFormats(Mapping[str, ArtifactFormat]):
    """`ARTIFACT_FORMATS[name]`: every backend's `ArtifactFormat` by format name, each imported on first use."""

    def __getitem__(self, name: str) -> ArtifactFormat:
        if name not in names():
            raise KeyError(name)
        return artifact_format(name)

    def __iter__(self) -> Iterator[str]:
        return iter(names())

    def __len__(self) -> int:
        return len(names())


ARTIFACT_FORMATS: Mapping[str, ArtifactFormat] = _ArtifactFormats()


def check_zip_archive(directory: Path, comp: dict[str, Any]) -> None:
    """A `.pt2` is a zip archive: its central directory must read, and no member name may leave the archive."""
    main = comp["main"]
    try:
        with zipfile.ZipFile(directory / main) as archive:
            members = archive.namelist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:
        raise ArtifactError(f"{main!r} is not a torch.export archive (a zip): {type(exc).__name__}: {exc}") from None
    for name in members:
        if name.startswith("/") or ".." in name.split("/") or "\\" in name:
            raise UnsafePathError(f"{main!r} has a member named {name!r}, which leaves the archive")


def single_regular_file(path: Path, rel: str) -> int:
    """The size of `path`, a regular file with one name (no symlink, hard link, device or pipe)."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISREG(info.st_mode):
        raise UnsafePathError(f"{rel!r} is a symlink or a special file; weights are read from regular files only")
    if info.st_nlink != 1:
        raise UnsafePathError(f"{rel!r} is a hard link (it has {info.st_nlink} names); copy the file instead")
    return info.st_size
