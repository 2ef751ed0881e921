"""The output of `hfexport export`: refusing, before any work, a target that cannot be written, and removing
what an interrupted export published (docs/cli.md, exit 130: "nothing half-written is left")."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from hfexport.cli.exits import UsageError
from hfexport.core.files import interrupts_deferred


def check_writable(output: Path) -> None:
    """Refuse, before any work, an output folder that cannot be created or written."""
    existing = next((p for p in (output, *output.parents) if p.exists()), Path.cwd())
    if not existing.is_dir():
        raise UsageError(f"--output {output}: {existing} is a file, not a folder")
    # A probe folder, created and removed where the output will go: permissions alone do not show a read-only
    # or pseudo file system (root may write everywhere the mode bits say).
    try:
        probe = tempfile.mkdtemp(prefix=".hfexport-probe-", dir=existing)
    except OSError as exc:
        raise UsageError(f"--output {output}: cannot create a folder in {existing} ({exc.strerror})") from None
    os.rmdir(probe)


def check_file_target(flag: str, path: Path, output: Path | None = None) -> None:
    """Refuse, before any work, a file to write whose folder does not exist or that is a folder itself (a file
    in the `--output` folder is fine: the save creates that folder first)."""
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a folder; name a file, e.g. {path / 'report.html'}")
    parent = path.parent
    if output is not None and parent.resolve() == output.resolve():
        return
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: the folder {parent} does not exist")


def _manifest_bytes(output: Path) -> bytes | None:
    try:
        return (output / "manifest.json").read_bytes()
    except OSError:
        return None


@contextlib.contextmanager
def nothing_left_on_interrupt(output: Path, reports: list[Path]) -> Iterator[None]:
    """Ctrl-C in the block: remove the artifact the command published in `output` before the interruption.

    An interrupted export leaves no folder that looks finished: its validation, report and "done" never came
    (docs/cli.md, exit 130: "nothing half-written is left"). Only what this command wrote goes: the artifact
    whose manifest differs from the one `output` held before (an `--overwrite` interrupted before its publish
    keeps the previous artifact): its manifest first (so what is left at any moment is no artifact, never a
    manifest without some of its files), the files it lists, the report files this command created in it;
    then the folders left empty, `output` itself when this command created it. A second Ctrl-C during the
    removal is held back until it is done.
    """
    existed = output.exists()
    before = _manifest_bytes(output)
    new_reports = [path for path in reports if not path.exists()]
    try:
        yield
    except KeyboardInterrupt:
        # Another Ctrl-C during the removal waits until it is done: never a manifest with some of its files.
        with interrupts_deferred():
            if _manifest_bytes(output) not in (None, before):
                _remove_artifact(output, new_reports, remove_folder=not existed)
        raise


def _remove_artifact(output: Path, reports: list[Path], remove_folder: bool) -> None:
    try:
        listed = json.loads((output / "manifest.json").read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # not a manifest this command wrote whole: nothing is removed
    root = output.resolve()
    # The manifest first: from then on the folder is no artifact (`load` refuses it), whatever stops the rest.
    for path in [output / "manifest.json", *(output / str(rel) for rel in listed), *reports]:
        resolved = path.resolve()
        if resolved != root and resolved.is_relative_to(root) and resolved.is_file():
            resolved.unlink()
    folders = sorted((p for p in root.rglob("*") if p.is_dir() and not p.is_symlink()), key=lambda p: -len(p.parts))
    for folder in [*folders, *([root] if remove_folder else [])]:
        with contextlib.suppress(OSError):  # not empty: a file this command did not write stays
            folder.rmdir()
    print(f"removed the unfinished artifact in {output}/", file=sys.stderr)
