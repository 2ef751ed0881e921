"""Sample inputs for a local model folder's image, speech and vision-language tasks, from its config files alone.

Text tasks take a tokenizer's encoding of fixed texts (`models.sample_inputs`). The others need no processor
and no real data: what the export traces is the shapes and dtypes, so the values are drawn from a seeded
generator and the shapes come from the folder's `config.json` (and `preprocessor_config.json` where the model
config does not say): an image's size and channels, a log-mel spectrogram's bins and frames, the number of
placeholder tokens an image takes in a LLaVA-style prompt.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfexport.cli.exits import UsageError
from hfexport.core.errors import InputError
from hfexport.core.model_files import read_folder_file

# Text tokens (the decoder prompt of a speech model; the prompt around the image of a VLM) when
# `--sequence-length` does not say.
DEFAULT_TEXT_LENGTH = {"speech-seq2seq": 4, "image-text-to-text": 8}
NON_TEXT_TASKS = ("image-classification", "speech-seq2seq", "image-text-to-text")


# The largest value a folder's config may set for a sample's axis. Real checkpoints are far below (2048-pixel
# images, 128 mel bins, 3000 frames, a few thousand image tokens); a config file is untrusted input, and an
# unbounded one allocates whatever it claims (a crop_size of 2**31).
AXIS_LIMITS = {
    "image side": 16384,
    "channels": 64,
    "mel bins": 4096,
    "frames": 1 << 20,
    "image tokens": 1 << 16,
    "vocabulary": 1 << 31,
    "token id": 1 << 31,
}
# The most elements one sample tensor may have (256 MiB of float32).
MAX_SAMPLE_ELEMENTS = 1 << 26


@contextmanager
def reading_folder(path: str | Path, what: str) -> Iterator[None]:
    """Turn what transformers, tokenizers or json raise on a malformed folder file (any type: `TypeError` from a
    field of the wrong type, the tokenizers library's bare `Exception`, `OSError` for an unparsable config) into
    one `UsageError` naming the folder and `what` was read, so the CLI answers exit 2 in one line."""
    try:
        yield
    except (UsageError, InputError):
        raise
    except Exception as exc:  # third-party readers of an untrusted file raise any type
        message = " ".join(str(exc).split())[:300]
        raise UsageError(f"--model {path}: {what} could not be read ({type(exc).__name__}: {message})") from None


def bounded(value: Any, what: str, source: str) -> int:
    """`value` as a sample's axis size or id, refused (one line naming where it came from) unless it is a whole
    number from 1 (0 for an id) to its limit in `AXIS_LIMITS`."""
    low = 0 if what == "token id" else 1
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= AXIS_LIMITS[what]:
        raise UsageError(
            f"{source} gives {what} {value!r}: a sample needs a whole number from {low} to {AXIS_LIMITS[what]}"
        )
    return value


def check_sample_size(shape: tuple[int, ...], what: str) -> None:
    """Refuse a sample tensor the config makes larger than `MAX_SAMPLE_ELEMENTS`, before it is allocated."""
    elements = math.prod(shape)
    if elements > MAX_SAMPLE_ELEMENTS:
        raise UsageError(
            f"the folder's config files make {what} of shape {list(shape)} ({elements} elements; at most "
            f"{MAX_SAMPLE_ELEMENTS}): export it from Python with your own inputs"
        )


@dataclass
class FolderSpec:
    """What a folder's config files say about its inputs."""

    config: Any
    preprocessor: dict[str, Any]


def read_folder(path: str | Path, trust_remote_code: bool = False) -> FolderSpec:
    import transformers

    with reading_folder(path, "config.json"):
        config = transformers.AutoConfig.from_pretrained(
            path, local_files_only=True, trust_remote_code=trust_remote_code
        )
    # Read as every file of a model folder is: from inside the folder, a regular file, bounded.
    data = read_folder_file(path, "preprocessor_config.json")
    try:
        preprocessor = json.loads(data) if data is not None else {}
    except (ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"{Path(path) / 'preprocessor_config.json'} is not JSON ({exc})") from None
    return FolderSpec(config, preprocessor if isinstance(preprocessor, dict) else {})


def _get(config: Any, *names: str) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def image_shape(spec: FolderSpec) -> tuple[int, int, int]:
    """(channels, height, width) of the model's images: the preprocessor's crop, else the (vision) config's
    `image_size`, else the preprocessor's resize."""
    vision = getattr(spec.config, "vision_config", None) or spec.config
    channels = _get(vision, "num_channels") or spec.preprocessor.get("num_channels") or 3
    channels = bounded(channels, "channels", "num_channels")
    sizes = {
        "preprocessor_config.json crop_size": spec.preprocessor.get("crop_size"),
        "config image_size": _get(vision, "image_size"),
        "preprocessor_config.json size": spec.preprocessor.get("size"),
    }
    for source, size in sizes.items():
        side = None
        if isinstance(size, int | float) and not isinstance(size, bool):
            side = (size, size)
        elif isinstance(size, list | tuple) and len(size) == 2:
            side = (size[0], size[1])
        elif isinstance(size, dict):
            if "height" in size and "width" in size:
                side = (size["height"], size["width"])
            elif "shortest_edge" in size:
                side = (size["shortest_edge"], size["shortest_edge"])
        if side is not None:
            return channels, bounded(side[0], "image side", source), bounded(side[1], "image side", source)
    raise UsageError(
        "the folder says no image size (config `image_size`, preprocessor_config.json `crop_size`/`size`): "
        "export it from Python with your own pixel_values"
    )


def _text_ids(spec: FolderSpec, batch: int, length: int, generator: Any) -> Any:
    import torch

    text = getattr(spec.config, "text_config", None) or spec.config
    vocab = _get(text, "vocab_size") or _get(spec.config, "vocab_size") or 128
    vocab = bounded(vocab, "vocabulary", "config vocab_size")
    check_sample_size((batch, length), "input_ids")
    # Ids 0-2 are usually pad/bos/eos; the rest of the vocabulary is ordinary text.
    return torch.randint(min(3, vocab - 1), vocab, (batch, length), generator=generator)


def _speech_inputs(spec: FolderSpec, batch: int, length: int, generator: Any) -> dict[str, Any]:
    import torch

    config = spec.config
    bins = _get(config, "num_mel_bins") or spec.preprocessor.get("feature_size")
    positions = _get(config, "max_source_positions")
    # Whisper's encoder takes exactly 2 * max_source_positions frames (its first conv has stride 2); a feature
    # extractor's `nb_max_frames` is that number for real checkpoints (3000).
    frames = 2 * positions if positions else spec.preprocessor.get("nb_max_frames")
    if not bins or not frames:
        raise UsageError(
            f"--task speech-seq2seq: the folder's {type(config).__name__} says no mel bins and frames "
            "(num_mel_bins/max_source_positions or the feature extractor's feature_size/nb_max_frames): "
            "export it from Python with your own input_features"
        )
    bins = bounded(bins, "mel bins", "num_mel_bins")
    frames = bounded(frames, "frames", "max_source_positions")
    check_sample_size((batch, bins, frames), "input_features")
    features = torch.randn(batch, bins, frames, generator=generator)
    start = _get(config, "decoder_start_token_id")
    ids = _text_ids(spec, batch, length, generator)
    if start is not None:
        ids[:, 0] = bounded(start, "token id", "config decoder_start_token_id")
    return {"input_features": features, "decoder_input_ids": ids}


def _vision_language_inputs(spec: FolderSpec, batch: int, length: int, generator: Any) -> dict[str, Any]:
    """A LLaVA-style prompt: one placeholder token per image feature after the first text token, then text."""
    import torch

    config = spec.config
    vision = getattr(config, "vision_config", None)
    token = _get(config, "image_token_id", "image_token_index")
    patch = _get(vision, "patch_size") if vision is not None else None
    if token is None or patch is None or _get(vision, "image_size") is None:
        raise UsageError(
            f"--task image-text-to-text: sample inputs are built from the config for LLaVA-style models "
            f"(image_token_id and a vision_config with image_size and patch_size); {type(config).__name__} "
            "needs its processor's inputs: export it from Python"
        )
    channels, height, width = image_shape(FolderSpec(config, {}))
    token = bounded(token, "token id", "config image_token_id")
    count = _get(config, "image_seq_length")
    if count is None:
        patch = bounded(patch, "image side", "vision_config patch_size")
        count = (height // patch) * (width // patch)
        if _get(config, "vision_feature_select_strategy") == "full":
            count += 1  # the CLS token's feature is kept too
    count = bounded(count, "image tokens", "config image_seq_length")
    ids = _text_ids(spec, batch, length, generator)
    ids[ids == token] = 3
    ids = torch.cat([ids[:, :1], torch.full((batch, count), token), ids[:, 1:]], dim=1)
    check_sample_size((batch, channels, height, width), "pixel_values")
    pixels = torch.randn(batch, channels, height, width, generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": pixels}


def folder_sample_inputs(
    path: str | Path,
    task: str,
    seed: int = 0,
    *,
    batch_size: int | None = None,
    sequence_length: int | None = None,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Forward kwargs for a folder model of a non-text `task` (one of `NON_TEXT_TASKS`), drawn from `seed`."""
    import torch

    spec = read_folder(path, trust_remote_code)
    generator = torch.Generator().manual_seed(seed)
    batch = batch_size or 2
    length = sequence_length or DEFAULT_TEXT_LENGTH.get(task, 0)
    if task == "image-classification":
        channels, height, width = image_shape(spec)
        check_sample_size((batch, channels, height, width), "pixel_values")
        return {"pixel_values": torch.randn(batch, channels, height, width, generator=generator)}
    if task == "speech-seq2seq":
        return _speech_inputs(spec, batch, length, generator)
    if task == "image-text-to-text":
        return _vision_language_inputs(spec, batch, length, generator)
    raise ValueError(f"no config-built sample inputs for task {task!r}; these tasks have them: {NON_TEXT_TASKS}")


# A folder without these has no tokenizer: its text inputs are built from the config (`text_inputs`).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.txt",
    "vocab.json",
    "tokenizer.model",
    "spiece.model",
    "sentencepiece.bpe.model",
)
# Text tokens of a config-built text sample when `--sequence-length` does not say (a tokenizer's encoding of
# the two fixed texts is about as long).
CONFIG_TEXT_LENGTH = 8


def has_tokenizer(path: str | Path) -> bool:
    return any((Path(path) / name).is_file() for name in TOKENIZER_FILES)


def text_inputs(
    path: str | Path,
    task: str,
    seed: int = 0,
    *,
    batch_size: int | None = None,
    sequence_length: int | None = None,
    trust_remote_code: bool = False,
) -> dict[str, Any]:
    """Text forward kwargs of a folder without a tokenizer (a checkpoint saved by `save_pretrained` alone), from
    its config, as optimum builds them: token ids drawn from `seed` over the vocabulary (the first three ids,
    usually special, left out), an all-ones mask, and for an encoder-decoder decoder ids that start with
    `decoder_start_token_id`. The length is capped at the model's maximum positions."""
    import torch

    spec = read_folder(path, trust_remote_code)
    generator = torch.Generator().manual_seed(seed)
    batch = batch_size or 2
    length = sequence_length or CONFIG_TEXT_LENGTH
    text = getattr(spec.config, "text_config", None) or spec.config
    positions = _get(text, "max_position_embeddings", "n_positions", "max_seq_len")
    if isinstance(positions, int) and positions > 0:
        length = min(length, positions)
    ids = _text_ids(spec, batch, length, generator)
    inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if task == "seq2seq-lm":
        decoder = _text_ids(spec, batch, DEFAULT_TEXT_LENGTH["speech-seq2seq"], generator)
        start = _get(spec.config, "decoder_start_token_id", "pad_token_id")
        if start is not None:
            decoder[:, 0] = bounded(start, "token id", "config decoder_start_token_id")
        inputs["decoder_input_ids"] = decoder
    return inputs
