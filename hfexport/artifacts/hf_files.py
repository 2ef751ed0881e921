"""The Hugging Face files of a saved export: config, generation config, tokenizer and processor files.

An artifact folder that holds them is usable like a Hugging Face folder: `AutoConfig.from_pretrained(out)` and
`AutoTokenizer.from_pretrained(out)` read them, and `hfexport.ExportedModelForCausalLM.from_pretrained(out)`
takes its config from them. `save` writes them at the top of the folder and lists each in the manifest with its
size and sha256, like every other file, so `load` refuses a tampered one.

They come from objects (`model.config.save_pretrained`, `tokenizer.save_pretrained`, `processor.save_pretrained`:
every file these write) or from a model folder (the files of `HF_FILE_NAMES` that are there, copied byte for
byte; weights are never copied: the export holds them). A model folder's files are read only from inside it
(`hfexport.core.model_files`: no symlink out, no FIFO or device, no file over `MAX_HF_FILE_BYTES`). A config,
tokenizer or processor file that names Python code of its own (`auto_map`, transformers' `trust_remote_code`)
is saved with that code, listed like every file, and `load` refuses an artifact whose files name code it does
not list: nothing hfexport writes or accepts makes `from_pretrained(out, trust_remote_code=True)` import an
unlisted file. hfexport itself never runs that code.
"""

from __future__ import annotations

import copy
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hfexport.artifacts.errors import ArtifactError
from hfexport.artifacts.paths import check_path
from hfexport.core.errors import InputError
from hfexport.core.model_files import (
    CODE_NAMING_FILES,
    HF_FILE_NAMES,
    MAX_HF_FILE_BYTES,
    check_folder_file,
    check_folder_files,
    json_object,
    read_folder_file,
)

HfFiles = dict[str, bytes]
# `module.Class` or `org/repo--module.Class`: how an `auto_map` names the code that defines a class.
_CODE_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# A module's relative imports (`from .x import y`, `import .x`), read as transformers reads them.
_RELATIVE_IMPORT = re.compile(r"^\s*(?:from\s+\.(\S+)\s+import|import\s+\.(\S+)\s*$)", re.MULTILINE)
# More modules than any model's code: beyond this a chain of relative imports is not followed.
_MAX_CODE_FILES = 64


def _read(path: Path) -> bytes:
    size = path.stat().st_size
    if size > MAX_HF_FILE_BYTES:
        raise ValueError(f"{path} is {size} bytes, more than a config or tokenizer file ({MAX_HF_FILE_BYTES})")
    return path.read_bytes()


def _class_references(value: Any) -> list[str]:
    """Every string in an `auto_map` value (a dict of Auto class -> reference, or a tokenizer's [slow, fast])."""
    found, stack = [], [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            found.append(item)
        elif isinstance(item, Mapping):
            stack.extend(reversed(list(item.values())))
        elif isinstance(item, list | tuple):
            stack.extend(reversed(item))
    return found


def code_references(files: Mapping[str, bytes]) -> dict[str, list[str]]:
    """{file: the class references of its `auto_map`}, for the files of `CODE_NAMING_FILES` among `files`.

    `auto_map` is how a config, tokenizer or processor file names Python code of its own (`"AutoConfig":
    "configuration_x.XConfig"`): with `trust_remote_code=True`, transformers imports `configuration_x.py` from
    the folder (or, for `org/repo--module.Class`, from that repository on the hub).
    """
    found: dict[str, list[str]] = {}
    for name in CODE_NAMING_FILES:
        refs = _class_references(json_object(files.get(name), for_auto_map=True).get("auto_map"))
        if refs:
            found[name] = refs
    return found


def code_file(reference: str) -> str | None:
    """The file of the folder that a class reference names (`configuration_x.XConfig` -> `configuration_x.py`),
    or None for code that is no file of the folder (`org/repo--module.Class`, or no plain module name)."""
    if "--" in reference:
        return None
    module, _, cls = reference.partition(".")
    return f"{module}.py" if _CODE_MODULE.match(module) and cls else None


def unlisted_code(files: Mapping[str, bytes], listed: set[str]) -> str | None:
    """Why the config files among `files` name code that `listed` does not hold, or None when they name none or
    all of it is listed: the reference, the file that names it, and the file it needs."""
    for name, refs in code_references(files).items():
        for ref in refs:
            needed = code_file(ref)
            if needed is None:
                return f"{name}'s auto_map names {ref!r}, code that is no file of the folder (another repository's)"
            if needed not in listed:
                return f"{name}'s auto_map names {ref!r}, code in {needed}"
    return None


def _code_files(folder: Path, files: Mapping[str, bytes], strict: bool = True) -> HfFiles:
    """The Python files of `folder` that the `auto_map` of `files` names, and the modules they import relatively,
    as `save_pretrained` of a model with its own code writes them; `InputError` for code the folder lacks
    (`strict`; otherwise what is there, and `collect` judges the files it keeps)."""
    wanted: list[str] = []
    for name, refs in code_references(files).items():
        for ref in refs:
            needed = code_file(ref)
            if needed is None and not strict:
                continue
            if needed is None:
                raise InputError(
                    f"{folder / name}: its auto_map names {ref!r}, code that is no file of the folder (another "
                    "repository's), which an artifact cannot list beside its config: remove that auto_map entry "
                    "(or save without this file)"
                )
            if needed not in wanted:
                wanted.append(needed)
    code: HfFiles = {}
    while wanted and len(code) < _MAX_CODE_FILES:
        needed = wanted.pop(0)
        if needed in code:
            continue
        data = read_folder_file(folder, needed)
        if data is None and not strict:
            continue
        if data is None:
            raise InputError(f"{folder}: its auto_map names code in {needed}, which the folder does not have")
        code[needed] = data
        text = data.decode("utf-8", errors="replace")
        for match in _RELATIVE_IMPORT.finditer(text):
            module = (match.group(1) or match.group(2)).split(".")[0]
            # A module the folder lacks is left to transformers to report, as it would for the folder itself.
            if _CODE_MODULE.match(module) and check_folder_file(folder, f"{module}.py") is not None:
                wanted.append(f"{module}.py")
    return code


def check_folder(folder: str | Path) -> None:
    """Refuse, before any export work, a model folder whose Hugging Face files `folder_files` would refuse:
    `InputError` naming the file (a symlink out of the folder, not a regular file, too large)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError(f"{folder} is not a folder")
    check_folder_files(folder, HF_FILE_NAMES)


def folder_files(folder: str | Path) -> HfFiles:
    """The files of `HF_FILE_NAMES` in a model folder, by name, and the Python files their `auto_map` names.

    Each is read as `hfexport.core.model_files` reads a model folder's files: only a regular file inside the folder
    (a symlink into it, or into the hub cache's blobs of the same repository, is read through), no larger than
    `MAX_HF_FILE_BYTES`; anything else is refused with `InputError` naming the file.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise InputError(f"{folder} is not a folder")
    files: HfFiles = {}
    for name in HF_FILE_NAMES:
        data = read_folder_file(folder, name)
        if data is not None:
            files[name] = data
    files.update(_code_files(folder, files))
    return files


def _saved_pretrained(obj: Any, what: str) -> HfFiles:
    """Every top-level file `obj.save_pretrained` writes (a tokenizer's or processor's files)."""
    if not hasattr(obj, "save_pretrained"):
        raise TypeError(f"{what} must have save_pretrained (a transformers {what}), got {type(obj).__name__}")
    with tempfile.TemporaryDirectory(prefix="hfexport-hf-files-") as tmp:
        obj.save_pretrained(tmp)
        return {p.name: _read(p) for p in sorted(Path(tmp).iterdir()) if p.is_file() and not p.is_symlink()}


def model_files(model: Any) -> HfFiles:
    """`config.json` and (when the model has one) `generation_config.json` of a `PreTrainedModel`."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "save_pretrained"):
        raise TypeError(f"model must be a transformers PreTrainedModel (with a config), got {type(model).__name__}")
    files = {}
    with tempfile.TemporaryDirectory(prefix="hfexport-hf-files-") as tmp:
        # The class that was exported, as `model.save_pretrained` records it (AutoExportedModel reads it).
        config = copy.copy(config)
        config.architectures = [type(model).__name__]
        config.save_pretrained(tmp)
        generation = getattr(model, "generation_config", None)
        if generation is not None and hasattr(generation, "save_pretrained"):
            generation.save_pretrained(tmp)
        for name in ("config.json", "generation_config.json"):
            if (Path(tmp) / name).is_file():
                files[name] = (Path(tmp) / name).read_bytes()
        # A config of a model with its own code names it in `auto_map`; save_pretrained wrote that code too.
        # (A folder's own config, when there is one, replaces this one: `collect` checks what it keeps.)
        files.update(_code_files(Path(tmp), files, strict=False))
    return files


def collect(
    *,
    model: Any = None,
    tokenizer: Any = None,
    processor: Any = None,
    files: Mapping[str, bytes] | str | Path | None = None,
) -> HfFiles:
    """The Hugging Face files to save beside an export, by file name.

    `files` (a model folder, or {name: bytes}) comes first; the model's config, the tokenizer's and the
    processor's files then add what it does not have (a folder's own `config.json` is kept byte for byte).
    """
    collected: HfFiles = {}
    if isinstance(files, (str, Path)):
        collected.update(folder_files(files))
    elif files is not None:
        for name, data in files.items():
            if not isinstance(data, (bytes, bytearray)):
                raise TypeError(f"hf_files[{name!r}] must be bytes, got {type(data).__name__}")
            collected[str(name)] = bytes(data)
    for extra in (
        model_files(model) if model is not None else {},
        _saved_pretrained(tokenizer, "tokenizer") if tokenizer is not None else {},
        _saved_pretrained(processor, "processor") if processor is not None else {},
    ):
        for name, data in extra.items():
            collected.setdefault(name, data)
    for name in collected:
        check_path(name, f"hf_files[{name!r}]")
        if "/" in name:
            raise ValueError(f"hf_files[{name!r}]: Hugging Face files sit at the top of the folder (a plain name)")
    # `load` refuses an artifact whose config names code it does not list (`hfexport check`): never write one.
    problem = unlisted_code(collected, set(collected))
    if problem is not None:
        raise InputError(f"hf_files: {problem}, which is not among the files to save: add it, or leave the file out")
    return collected


def listed_hf_files(manifest: Mapping[str, Any]) -> list[str]:
    """The files a manifest lists that belong to no component: the Hugging Face files `save` wrote."""
    owned = {path for comp in manifest["components"].values() for path in comp["files"]}
    return [path for path in manifest["files"] if path not in owned]


def check_listed_code(directory: Path, listed: set[str]) -> None:
    """Refuse an artifact whose config, tokenizer or processor files (listed or not: transformers reads them
    either way) name Python code in `auto_map` that `listed` (the manifest's files) does not hold."""
    files: HfFiles = {}
    for name in CODE_NAMING_FILES:
        try:
            data = read_folder_file(directory, name)
        except InputError as exc:
            raise ArtifactError(str(exc)) from None
        if data is not None:
            files[name] = data
    problem = unlisted_code(files, listed)
    if problem is not None:
        raise ArtifactError(
            f"{directory}: {problem}, which its manifest does not list: from_pretrained(..., "
            "trust_remote_code=True) on this folder would run code no checksum covers"
        )
