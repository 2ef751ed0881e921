"""The Hugging Face files of a saved export: config, generation config, tokenizer and processor files.

An artifact folder that holds them is usable like a Hugging Face folder: `AutoConfig.from_pretrained(out)` and
`AutoTokenizer.from_pretrained(out)` read them, and `hfexport.ExportedModelForCausalLM.from_pretrained(out)`
takes its config from them. `save` writes them at the top of the folder and lists each in the manifest with its
size and sha256, like every other file, so `load` refuses a tampered one.

They come from objects (`model.config.save_pretrained`, `tokenizer.save_pretrained`, `processor.save_pretrained`:
every file these write) or from a model folder (the files of `HF_FILE_NAMES` that are there, copied byte for
byte; weights are never copied: the export holds them).
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from hfexport.artifacts.paths import check_path

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
# this is not one of these, and is refused rather than copied.
MAX_HF_FILE_BYTES = 256 * 1024 * 1024

HfFiles = dict[str, bytes]


def _read(path: Path) -> bytes:
    size = path.stat().st_size
    if size > MAX_HF_FILE_BYTES:
        raise ValueError(f"{path} is {size} bytes, more than a config or tokenizer file ({MAX_HF_FILE_BYTES})")
    return path.read_bytes()


def folder_files(folder: str | Path) -> HfFiles:
    """The files of `HF_FILE_NAMES` in a model folder, by name (a symlink, as in the hub cache, is read through)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"{folder} is not a folder")
    return {name: _read(folder / name) for name in HF_FILE_NAMES if (folder / name).is_file()}


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
    return collected


def listed_hf_files(manifest: Mapping[str, Any]) -> list[str]:
    """The files a manifest lists that belong to no component: the Hugging Face files `save` wrote."""
    owned = {path for comp in manifest["components"].values() for path in comp["files"]}
    return [path for path in manifest["files"] if path not in owned]
