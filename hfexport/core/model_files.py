"""The files of a model folder, read as files that anyone may have written (a git clone, a download, a cache).

A model folder's config, tokenizer and processor files are read (and copied into an artifact) only when each is
a regular file that stays inside the folder: a symlink is followed only when it resolves inside the folder, or,
for a Hugging Face hub cache snapshot (`.../models--org--name/snapshots/<revision>/file ->
../../blobs/<sha>`), into that same repository's `blobs/` folder. A FIFO, a device, a folder, a `/proc` file or
a symlink anywhere else is refused with `InputError` naming the file, and so is a file larger than the reader's
cap, from its size on disk before a byte is read. A symlink swapped after the check is caught on the opened
file itself (its type and size from `fstat`, and on Linux the path `/proc/self/fd` gives for it), so what is
read is what was checked.

`code_needed` says whether a folder's files need Python code of their own (transformers' `trust_remote_code`),
from the files alone: nothing of the folder is imported. Standard library only (and `hfexport.core.errors`;
transformers' tables are imported only for a file that has an `auto_map`), so any layer may use it.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfexport.core.errors import InputError
from hfexport.core.files import is_inside_model_folder

# The files of a Hugging Face folder besides the weights that `from_pretrained` of a config, a generation
# config, a tokenizer or a processor reads. Copied from a model folder when present.
HF_FILE_NAMES: tuple[str, ...] = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
    "chat_template.json",
    "chat_template.jinja",
)
# Larger than any tokenizer or config file (the biggest tokenizer.json files are tens of MiB): a file above
# this is not one of these, and is refused rather than read.
MAX_HF_FILE_BYTES = 256 * 1024 * 1024
# The files whose `auto_map` names Python code of the folder (transformers' `trust_remote_code`): a config's,
# a tokenizer's, a processor's. Parsed whole to find it, so held to a smaller cap (real ones are KiB to a few MiB).
CODE_NAMING_FILES: tuple[str, ...] = (
    "config.json",
    "tokenizer_config.json",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)
MAX_CONFIG_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class FolderFile:
    """A checked file of a model folder: where it is (`real`: every symlink resolved) and its size."""

    path: Path
    real: Path
    size: int


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def max_bytes_of(name: str) -> int:
    """The size cap of a model folder's file: `MAX_CONFIG_BYTES` for the files parsed whole for an `auto_map`,
    `MAX_HF_FILE_BYTES` for the others."""
    return MAX_CONFIG_BYTES if name in CODE_NAMING_FILES else MAX_HF_FILE_BYTES


def check_folder_file(folder: str | Path, name: str, max_bytes: int | None = None) -> FolderFile | None:
    """The file `name` of a model folder once checked (nothing is opened), or None when there is none.

    Raises `InputError` naming the file when it leads outside the folder (and its hub cache blobs), is not a
    regular file, or is larger than `max_bytes` (default: `max_bytes_of(name)`). A symlink that leads nowhere
    counts as no file.
    """
    max_bytes = max_bytes_of(name) if max_bytes is None else max_bytes
    folder = Path(folder)
    path = folder / name
    try:
        os.lstat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise InputError(f"{path}: cannot be read ({exc.strerror})") from None
    real = Path(os.path.realpath(path))
    if not is_inside_model_folder(real, Path(folder)):
        if not os.path.lexists(real):
            return None
        raise InputError(
            f"{path} leads to {real}, outside the model folder: a model folder's files are read only from the "
            "folder itself (or its hub cache blobs); copy the file into the folder if it is meant to be there"
        )
    try:
        info = os.stat(real)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise InputError(f"{path}: cannot be read ({exc.strerror})") from None
    if not stat.S_ISREG(info.st_mode):
        raise InputError(f"{path} is {_kind(info.st_mode)}, not a regular file: refused")
    if info.st_size > max_bytes:
        raise InputError(
            f"{path} is {info.st_size} bytes, more than a config or tokenizer file can be ({max_bytes}): refused"
        )
    return FolderFile(path, real, info.st_size)


def read_folder_file(folder: str | Path, name: str, max_bytes: int | None = None) -> bytes | None:
    """The bytes of the file `name` of a model folder (`check_folder_file`'s rules), or None when there is none.

    The checks are repeated on the opened file, so a file swapped for a symlink, a FIFO or a larger file between
    the check and the read is refused, not read.
    """
    max_bytes = max_bytes_of(name) if max_bytes is None else max_bytes
    checked = check_folder_file(folder, name, max_bytes)
    if checked is None:
        return None
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(checked.real, flags)
    except OSError as exc:
        raise InputError(f"{checked.path}: changed while it was read, or cannot be read ({exc.strerror})") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > max_bytes:
            raise InputError(f"{checked.path}: changed while it was read (now {_kind(info.st_mode)} or larger)")
        opened = f"/proc/self/fd/{fd}"
        if os.path.islink(opened) and not is_inside_model_folder(Path(os.readlink(opened)), Path(folder)):
            raise InputError(f"{checked.path}: changed while it was read (it now leads outside the model folder)")
        chunks, left = [], info.st_size
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        # A file that reads more than its size says (a /proc file says 0) is not a file at rest.
        if left or os.read(fd, 1):
            raise InputError(f"{checked.path}: its size changed while it was read (or it is not a file on disk)")
        return b"".join(chunks)
    finally:
        os.close(fd)


def check_folder_files(folder: str | Path, names: tuple[str, ...] = HF_FILE_NAMES) -> list[FolderFile]:
    """Check the files `names` of a model folder up front (nothing is read): those present, in order."""
    return [checked for name in names if (checked := check_folder_file(folder, name)) is not None]


def json_object(data: bytes | None, *, for_auto_map: bool = False) -> dict[str, Any]:
    """A config file's JSON object, or {} for anything else (not JSON, not an object, nested past Python's
    recursion limit): what transformers would refuse to load holds no `auto_map` it would act on.

    `for_auto_map`: the caller wants only the `auto_map`, so a file that cannot hold one is not parsed.
    """
    if not data:
        return {}
    # No `auto_map` key and no escape that could spell it (`\u0061uto_map`): nothing to parse for.
    if for_auto_map and b"auto_map" not in data and b"\\u" not in data:
        return {}
    try:
        value = json.loads(data)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return {}
    return value if isinstance(value, dict) else {}


def code_needed(files: Mapping[str, bytes]) -> str | None:
    """Why loading these Hugging Face files needs Python code of their own, or None when transformers' classes
    load them (as `from_pretrained(..., trust_remote_code=False)` decides; an `auto_map` beside a model type
    transformers knows is not needed, and not run).

    Checks `config.json` (a `model_type` transformers does not know, with an `AutoConfig` in `auto_map`) and
    `tokenizer_config.json` (an `AutoTokenizer` in `auto_map`, and neither the model type nor `tokenizer_class`
    names a transformers tokenizer).
    """
    config = json_object(files.get("config.json"))
    model_type = config.get("model_type")
    auto_map = config.get("auto_map")
    tokenizer = json_object(files.get("tokenizer_config.json"))
    if not auto_map and not tokenizer.get("auto_map"):
        return None  # the common case, decided without importing transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    known_type = isinstance(model_type, str) and model_type in CONFIG_MAPPING_NAMES
    if isinstance(auto_map, Mapping) and "AutoConfig" in auto_map and not known_type:
        return (
            f"config.json needs the folder's own Python code (model_type {model_type!r} is not a transformers "
            f"model; its auto_map names {auto_map['AutoConfig']!r})"
        )
    tokenizer_map = tokenizer.get("auto_map")
    if isinstance(tokenizer_map, Mapping):
        tokenizer_map = tokenizer_map.get("AutoTokenizer")
    if tokenizer_map:
        from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES, tokenizer_class_from_name

        name = tokenizer.get("tokenizer_class")
        base = name.removesuffix("Fast") if isinstance(name, str) and name else None
        known = base is not None and any(tokenizer_class_from_name(c) is not None for c in (base, base + "Fast"))
        if not known and not (isinstance(model_type, str) and model_type in TOKENIZER_MAPPING_NAMES):
            return (
                f"tokenizer_config.json needs the folder's own Python code (tokenizer_class {name!r} is not a "
                f"transformers tokenizer; its auto_map names {tokenizer_map!r})"
            )
    return None
