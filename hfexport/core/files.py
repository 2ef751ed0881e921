"""Atomic writes: stage beside the destination, flush, then rename into place. The one implementation.

Everything hfexport writes to disk goes through here: a saved artifact (`hfexport.save`: a whole folder,
swapped in with `replace_folder`), a manifest update (`write_text_atomically`: one file, `os.replace`), and
an exporter's `output_path` (`save_atomically`: a model file and its side files, moved in last-file-first).
A temporary is named `.<destination>.hfexport-tmp-<host>-<pid>-<random>` beside its destination, on the
same filesystem, so the final rename is atomic; one left by a killed writer on this host is removed by the
next write into the same place (`remove_dead_temporaries`). A clean-up that must not stop halfway runs under
`interrupts_deferred`: a Ctrl-C meanwhile arrives once it is done.

This module imports only the standard library, so any layer may use it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import re
import secrets
import shutil
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def fsync(path: Path) -> None:
    """Flush a file or a folder to disk (a rename is only as durable as the data it publishes)."""
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def digest(path: Path) -> dict[str, Any]:
    """`{"size": bytes, "sha256": hex}` of a file, read in 1 MiB blocks."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
    return {"size": path.stat().st_size, "sha256": sha.hexdigest()}


def is_inside(path: Path, root: Path) -> bool:
    """Whether `path`, with every symlink resolved, stays under `root`."""
    try:
        path.resolve(strict=False).relative_to(root.resolve())
    except ValueError:
        return False
    return True


def is_inside_model_folder(path: Path, folder: Path) -> bool:
    """Whether `path`, with every symlink resolved, stays in the model folder `folder`, or (a Hugging Face hub
    cache snapshot, `models--org--name/snapshots/<revision>/`, whose files are links to `../../blobs/<hash>`) in
    the same repository's `blobs/` folder."""
    if is_inside(path, folder):
        return True
    snapshots = folder.resolve().parent
    repository = snapshots.parent
    return (
        snapshots.name == "snapshots"
        and repository.name.startswith("models--")
        and is_inside(path, repository / "blobs")
    )


# -- temporaries -------------------------------------------------------------------------------------------


def _tmp_prefix(destination: Path) -> str:
    return f".{destination.name}.hfexport-tmp-"


def _host() -> str:
    # A folder on a shared filesystem can be written from several machines: a process id means something
    # only on the host that made it.
    return hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def temporary_beside(destination: Path, kind: str = "") -> Path:
    """A fresh temporary path beside `destination` (not created), named after this host and process."""
    return destination.parent / f"{_tmp_prefix(destination)}{_host()}-{os.getpid()}-{kind}{secrets.token_hex(4)}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_dead_temporaries(destination: Path) -> None:
    """Remove temporaries that a killed writer into `destination` on this host left beside it."""
    prefix = f"{_tmp_prefix(destination)}{_host()}-"
    parent = destination.parent
    if not parent.is_dir():
        return
    for entry in parent.iterdir():
        if not entry.name.startswith(prefix):
            continue
        pid = entry.name[len(prefix) :].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


# -- publishing --------------------------------------------------------------------------------------------

_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2); False where the libc or filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def replace_folder(tmp: Path, destination: Path) -> Path | None:
    """Publish the complete folder `tmp` as `destination`, replacing what is there in one step where it can.

    A non-empty `destination` is swapped with `tmp` (renameat2 RENAME_EXCHANGE), or, where the filesystem
    cannot, renamed away first; an absent or empty one is replaced by one `rename`, which fails on a
    non-empty folder that appeared meanwhile. Returns the folder that now holds the previous contents (for
    the caller to remove what it knows it may remove), or None. The caller decides whether `destination`
    may be replaced.
    """
    previous: Path | None = None
    if destination.is_dir() and any(destination.iterdir()):
        if exchange(tmp, destination):
            previous = tmp  # now the previous contents
        else:
            # Two renames: a kill between them leaves no destination (and the old contents in `old`).
            previous = temporary_beside(destination, "old-")
            os.rename(destination, previous)
            os.rename(tmp, destination)
    else:
        os.rename(tmp, destination)
    fsync(destination.parent)
    return previous


def write_text_atomically(path: Path, text: str, errors: str = "strict") -> None:
    """Replace the file `path` with `text` (UTF-8; `errors` as `str.encode` takes it) in one rename: a reader
    sees the old file or the new, never half."""
    remove_dead_temporaries(path)
    tmp = temporary_beside(path)
    try:
        tmp.write_text(text, encoding="utf-8", errors=errors)
        fsync(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync(path.parent)


def save_atomically(
    destination: Path, write: Callable[[Path], None], *, side_files_named_by_main: bool = False
) -> None:
    """Run `write(path)` into a staging folder beside `destination`, then move its files into place.

    The model file itself (`destination`) moves last, after its side files (`.onnx.data`, `.bin`), so whoever
    sees it sees it complete; on any failure nothing is left: no staged files, no folders this call created.

    `side_files_named_by_main` (ONNX: the graph names its `.data` file, and the writer names that file after
    the path it writes to): an existing pair is replaced so that a reader sees the old pair or the new one,
    never the old graph with new weights. The new side files get names no file has (`model.onnx.data`, or
    `model.hfexport-<random>.onnx.data` while that one exists), the one rename of the model file publishes the
    new pair, and only then are the old pair's side files removed, as is a stale `.data` when the new export
    has none. Without it (OpenVINO finds its `.bin` by name) the side files are replaced in place first.
    A failure or Ctrl-C before the model file's rename removes the new side files already moved beside the old
    pair (those that replaced no file), so no `model.hfexport-<hex>.onnx.data` is left behind.
    """
    created = [p for p in (destination.parent, *destination.parent.parents) if not p.exists()]
    destination.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_temporaries(destination)
    staging = temporary_beside(destination)
    main_name = destination.name
    if side_files_named_by_main and (destination.parent / f"{destination.name}.data").exists():
        main_name = f"{destination.stem}.hfexport-{secrets.token_hex(4)}{destination.suffix}"
    moved: list[Path] = []  # side files already in place that replaced no file: removed again on failure
    main_id: tuple[int, int] | None = None
    try:
        staging.mkdir()
        write(staging / main_name)
        produced = sorted(staging.iterdir(), key=lambda p: p.name == main_name)
        for path in produced:
            fsync(path)
        main_id = _file_id(staging / main_name)
        for path in produced:
            target = destination if path.name == main_name else destination.parent / path.name
            fresh = side_files_named_by_main or not os.path.lexists(target)
            os.replace(path, target)
            if target != destination and fresh:
                moved.append(target)
        fsync(destination.parent)
    except BaseException:
        # A Ctrl-C during this clean-up would leave half of it: it is delivered once the clean-up is done.
        with interrupts_deferred():
            if main_id is None or _file_id(destination) != main_id:  # the new model file is not published
                for target in moved:
                    target.unlink(missing_ok=True)
            shutil.rmtree(staging, ignore_errors=True)
            for folder in created:  # innermost first
                try:
                    folder.rmdir()
                except OSError:
                    break
        raise
    shutil.rmtree(staging, ignore_errors=True)
    if side_files_named_by_main:
        kept = {p.name for p in produced}
        for stale in _side_family(destination):
            if stale.name not in kept:
                stale.unlink(missing_ok=True)


def _file_id(path: Path) -> tuple[int, int] | None:
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold back SIGINT (Ctrl-C) in the block and deliver it when the block ends, to the handler there was.

    For clean-ups that must not stop halfway (removing an artifact, rolling back a half-moved file pair): a
    second Ctrl-C while one runs is not lost, it arrives once the clean-up is complete. Signal handlers belong
    to the main thread: elsewhere the block runs as it is.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, _frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received and previous not in (signal.SIG_IGN, None):
            signal.raise_signal(signal.SIGINT)


def _side_family(destination: Path) -> list[Path]:
    """The side files an earlier `save_atomically(..., side_files_named_by_main=True)` of `destination` wrote:
    `model.onnx.data`, or `model.hfexport-<8 hex>.onnx.data`."""
    pattern = re.compile(
        rf"^(?:{re.escape(destination.name)}|{re.escape(destination.stem)}\.hfexport-[0-9a-f]{{8}}"
        rf"{re.escape(destination.suffix)})\.data$"
    )
    parent = destination.parent
    return [p for p in parent.iterdir() if pattern.match(p.name) and p.is_file()] if parent.is_dir() else []
