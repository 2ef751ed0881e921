"""What the commands build from their arguments: the model (a built-in tiny one or a local folder, loaded for
its task) and its sample inputs. The export config is `hfexport.cli.export_config`."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hfexport.cli.exits import UsageError
from hfexport.cli.folder_inputs import (
    DEFAULT_TEXT_LENGTH,
    NON_TEXT_TASKS,
    folder_sample_inputs,
    has_tokenizer,
    reading_folder,
    text_inputs,
)

# --task -> the transformers Auto class a local model folder is loaded with.
TASKS: dict[str, str] = {
    "causal-lm": "AutoModelForCausalLM",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
    "feature-extraction": "AutoModel",
    "sequence-classification": "AutoModelForSequenceClassification",
    "masked-lm": "AutoModelForMaskedLM",
    "image-classification": "AutoModelForImageClassification",
    "speech-seq2seq": "AutoModelForSpeechSeq2Seq",
    "image-text-to-text": "AutoModelForImageTextToText",
}
# The Hugging Face pipeline task names (as optimum-cli and transformers.pipeline spell them) -> ours.
HF_TASKS: dict[str, str] = {
    "text-generation": "causal-lm",
    "text2text-generation": "seq2seq-lm",
    "summarization": "seq2seq-lm",
    "translation": "seq2seq-lm",
    "feature-extraction": "feature-extraction",
    "sentence-similarity": "feature-extraction",
    "text-classification": "sequence-classification",
    "fill-mask": "masked-lm",
    "image-classification": "image-classification",
    "automatic-speech-recognition": "speech-seq2seq",
    "image-text-to-text": "image-text-to-text",
    "text-generation-with-past": "causal-lm",
    "text2text-generation-with-past": "seq2seq-lm",
    "automatic-speech-recognition-with-past": "speech-seq2seq",
    "image-text-to-text-with-past": "image-text-to-text",
}
# The pipeline names whose export is what `generate` runs, as optimum's `-with-past` exports are: they imply
# `--generation` (the components with their cache). `text-generation` too: a causal LM's single forward graph
# cannot generate, and a user naming that task means to.
GENERATION_TASKS = tuple(name for name in HF_TASKS if name == "text-generation" or name.endswith("-with-past"))
TASK_CHOICES: tuple[str, ...] = ("auto", *TASKS, *(name for name in HF_TASKS if name not in TASKS))
# The task of each built-in tiny model's family.
_FAMILY_TASKS = {
    "causal_lm": "causal-lm",
    "seq2seq": "seq2seq-lm",
    "speech_seq2seq": "speech-seq2seq",
    "image_text": "image-text-to-text",
}
# Tasks whose sample inputs a local folder's tokenizer gives; the others (`NON_TEXT_TASKS`) are built from its
# config files (`folder_inputs`).
_TEXT_TASKS = ("causal-lm", "seq2seq-lm", "feature-extraction", "sequence-classification", "masked-lm")
DTYPES = ("float32", "float16", "bfloat16")
# optimum-cli's spellings of the same dtypes (`--dtype fp16`), and torch's short names.
_DTYPE_ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "half": "float16", "float": "float32"}
# Architecture suffix -> task, for `--task auto` on a folder.
_SUFFIX_TASKS = {
    "ForCausalLM": "causal-lm",
    "ForConditionalGeneration": "seq2seq-lm",
    "ForSequenceClassification": "sequence-classification",
    "ForMaskedLM": "masked-lm",
    "ForImageClassification": "image-classification",
    "ForSpeechSeq2Seq": "speech-seq2seq",
}


def dtype_name(value: str) -> str:
    """`--dtype` as torch names it: `fp16`/`bf16`/`fp32` (optimum-cli's spellings) and any case are accepted."""
    value = value.strip().lower()
    return _DTYPE_ALIASES.get(value, value)


def canonical_task(task: str) -> str:
    """Our task name for `task` (ours or a Hugging Face pipeline name)."""
    return task if task in TASKS or task == "auto" else HF_TASKS[task]


def check_model_spec(spec: str, task: str, trust_remote_code: bool = False) -> None:
    """Refuse, before any work, a `--model` that is neither built in nor a loadable folder, a `--task` that
    does not fit it, a folder whose config or tokenizer files would be refused when saved beside the export
    (`hfexport.core.model_files`: a symlink out of the folder, not a regular file, too large), and one that needs
    its own Python code without `--trust-remote-code`."""
    from hfexport.core.model_files import HF_FILE_NAMES, check_folder_files, code_needed, read_folder_file
    from hfexport.tiny import TINY_MODELS

    task = canonical_task(task)
    if spec in TINY_MODELS:
        own = _FAMILY_TASKS[TINY_MODELS[spec].family]
        if task not in ("auto", own):
            raise UsageError(f"--task {task} does not apply to the built-in {spec} (a {own} model): drop --task")
        return
    path = Path(spec)
    if not path.is_dir():
        raise UsageError(f"--model {spec!r} is neither a built-in ({', '.join(TINY_MODELS)}) nor a local model folder")
    if not (path / "config.json").is_file():
        raise UsageError(f"--model {spec}: the folder has no config.json (is it a Hugging Face model folder?)")
    weights = [p for p in path.iterdir() if p.suffix in (".safetensors", ".bin") or p.name.endswith(".index.json")]
    if not weights:
        raise UsageError(f"--model {spec}: the folder has no weights (*.safetensors or pytorch_model*.bin)")
    check_folder_files(path, HF_FILE_NAMES)  # InputError naming the file: exit 2
    if not trust_remote_code:
        files = {name: read_folder_file(path, name) for name in ("config.json", "tokenizer_config.json")}
        needs = code_needed({name: data for name, data in files.items() if data is not None})
        if needs is not None:
            raise UsageError(f"--model {spec}: {needs}; hfexport runs none unless you pass --trust-remote-code")


def _folder_task(path: Path, task: str, trust_remote_code: bool = False) -> str:
    """`task`, or for `auto` the one the folder's config (`architectures`) names."""
    if task != "auto":
        return task
    import transformers
    from transformers.models.auto import modeling_auto

    # Never transformers' default (None), which asks on stdin whether to run the folder's code.
    with reading_folder(path, "config.json"):
        config = transformers.AutoConfig.from_pretrained(
            path, local_files_only=True, trust_remote_code=trust_remote_code
        )
    architectures = getattr(config, "architectures", None)
    architecture = architectures[0] if isinstance(architectures, list) and architectures else ""
    architecture = architecture if isinstance(architecture, str) else ""  # config data: anything else names none
    if architecture.endswith("ForConditionalGeneration"):
        # Whisper and LLaVA are "ForConditionalGeneration" too: the Auto mappings say which kind it is.
        if type(config) in modeling_auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING:
            return "speech-seq2seq"
        if type(config) in modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
            return "image-text-to-text"
    return next((t for suffix, t in _SUFFIX_TASKS.items() if architecture.endswith(suffix)), "feature-extraction")


def load_model(
    spec: str,
    task: str = "auto",
    *,
    dtype: str | None = None,
    batch_size: int | None = None,
    sequence_length: int | None = None,
    trust_remote_code: bool = False,
) -> tuple[Any, dict[str, Any]]:
    """The model `--model` names and sample inputs for it (`batch_size` x `sequence_length` text tokens)."""
    import torch

    from hfexport.tiny import TINY_MODELS

    if spec in TINY_MODELS:
        model = TINY_MODELS[spec].build()
        if dtype:
            model = model.to(getattr(torch, dtype))
        return model, sample_inputs(spec, dtype=dtype, batch_size=batch_size, sequence_length=sequence_length)
    check_model_spec(spec, task, trust_remote_code)
    path = Path(spec)
    task = _folder_task(path, canonical_task(task), trust_remote_code)
    import transformers

    options: dict[str, Any] = {"local_files_only": True, "trust_remote_code": trust_remote_code}
    if dtype:
        options["dtype"] = getattr(torch, dtype)
    # The sample first: it reads only the folder's config files, so a malformed one is refused before the weights
    # are loaded.
    inputs = sample_inputs(
        spec, task=task, batch_size=batch_size, sequence_length=sequence_length, trust_remote_code=trust_remote_code
    )
    model = getattr(transformers, TASKS[task]).from_pretrained(path, **options).eval()
    _say_where_inputs_come_from(spec, task, inputs)
    return model, drop_untaken(model, inputs)


def load_empty_model(
    spec: str,
    task: str = "auto",
    *,
    dtype: str | None = None,
    batch_size: int | None = None,
    sequence_length: int | None = None,
    trust_remote_code: bool = False,
) -> tuple[Any, dict[str, Any], str]:
    """`--low-memory`: the folder's model with weights that hold no memory, sample inputs, and its Auto class."""
    import torch

    from hfexport.frontends.empty_weights import empty_model
    from hfexport.tiny import TINY_MODELS

    if spec in TINY_MODELS:
        raise UsageError(f"--low-memory streams weights from a checkpoint folder; {spec} is built in: save it first")
    check_model_spec(spec, task, trust_remote_code)
    task = _folder_task(Path(spec), canonical_task(task), trust_remote_code)
    if task not in _TEXT_TASKS:
        raise UsageError(f"--model {spec} is a {task} model: sample inputs are built from a folder only for text tasks")
    model = empty_model(
        spec, TASKS[task], dtype=getattr(torch, dtype) if dtype else None, trust_remote_code=trust_remote_code
    )
    inputs = sample_inputs(
        spec, batch_size=batch_size, sequence_length=sequence_length, trust_remote_code=trust_remote_code, task=task
    )
    _say_where_inputs_come_from(spec, task, inputs)
    return model, drop_untaken(model, inputs), TASKS[task]


def inputs_source(spec: str, task: str = "auto") -> str:
    """Where the sample inputs of `--model` come from, in words (the manifest records it)."""
    from hfexport.tiny import TINY_MODELS

    if spec in TINY_MODELS:
        return "the built-in model's seeded sample"
    task = _folder_task(Path(spec), canonical_task(task))
    if task in NON_TEXT_TASKS:
        return "the folder's config files (shapes), values drawn from a fixed seed"
    if has_tokenizer(spec):
        return "the folder's tokenizer on fixed texts"
    return "the folder's config (no tokenizer: token ids drawn from vocab_size with a fixed seed)"


def _say_where_inputs_come_from(spec: str, task: str, inputs: dict[str, Any]) -> None:
    """One line on stderr when a text model's folder has no tokenizer: its inputs were built from the config."""
    if task in NON_TEXT_TASKS or has_tokenizer(spec):
        return
    shapes = ", ".join(f"{k} {list(v.shape)}" for k, v in inputs.items())
    print(f"note: {spec} has no tokenizer: sample inputs built from its config ({shapes})", file=sys.stderr)


def drop_untaken(model: Any, inputs: dict[str, Any]) -> dict[str, Any]:
    """`inputs` without those the model's forward does not name (a tokenizer's `token_type_ids` for a decoder-only
    model, which `generate` refuses); one line on stderr names what was dropped."""
    import inspect

    parameters = inspect.signature(model.forward).parameters
    named = {n for n, p in parameters.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    dropped = [name for name in inputs if name not in named]
    if dropped:
        print(
            f"note: dropped {', '.join(dropped)} from the sample inputs: {type(model).__name__}.forward does not "
            "take it",
            file=sys.stderr,
        )
    return {k: v for k, v in inputs.items() if k in named}


def sample_inputs(
    spec: str,
    seed: int = 0,
    *,
    dtype: str | None = None,
    batch_size: int | None = None,
    sequence_length: int | None = None,
    trust_remote_code: bool = False,
    task: str = "auto",
) -> dict[str, Any]:
    """Sample inputs for the model `--model` names, without loading its weights: a built-in's own (drawn from
    `seed`, float inputs cast to `dtype`), a folder tokenizer's on fixed texts (padded or truncated) for a text
    `task`, or for an image, speech or vision-language task inputs shaped by the folder's config files."""
    import torch

    from hfexport.tiny import TINY_MODELS

    if spec in TINY_MODELS:
        inputs = TINY_MODELS[spec].sample_inputs(seed=seed, batch=batch_size, length=sequence_length)
        if dtype:
            inputs = {k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v for k, v in inputs.items()}
        return inputs
    task = _folder_task(Path(spec), canonical_task(task), trust_remote_code)
    if task in NON_TEXT_TASKS:
        inputs = folder_sample_inputs(
            spec,
            task,
            seed,
            batch_size=batch_size,
            sequence_length=sequence_length,
            trust_remote_code=trust_remote_code,
        )
        if dtype:
            inputs = {k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v for k, v in inputs.items()}
        return inputs
    if not has_tokenizer(spec):  # a checkpoint saved without its tokenizer: ids drawn from the config
        return text_inputs(
            spec,
            task,
            seed,
            batch_size=batch_size,
            sequence_length=sequence_length,
            trust_remote_code=trust_remote_code,
        )
    from transformers import AutoTokenizer

    batch = batch_size or 2
    texts = (["Hello, world!", "Export me"] * batch)[:batch]
    shape: dict[str, Any] = {"padding": True}
    if sequence_length:
        shape = {"padding": "max_length", "max_length": sequence_length, "truncation": True}
    with reading_folder(spec, "the tokenizer"):
        tokenizer = AutoTokenizer.from_pretrained(spec, local_files_only=True, trust_remote_code=trust_remote_code)
        encoded = tokenizer(texts, return_tensors="pt", **shape)
    return {k: v for k, v in encoded.items() if isinstance(v, torch.Tensor)}


def other_samples(
    spec: str,
    inputs: dict[str, Any],
    *,
    dtype: str | None = None,
    batch_size: int | None = None,
    sequence_length: int | None = None,
    trust_remote_code: bool = False,
    task: str = "auto",
) -> dict[str, dict[str, Any]]:
    """Sample inputs of other shapes for `--validate`: a grown sequence (+3 tokens), a long one (4x + 1) and
    another batch (+1) around the traced sample `inputs`, each drawn like it (`sample_inputs`, without loading
    weights again); those whose shapes equal the sample's are left out."""
    from hfexport.tiny import TINY_MODELS

    if spec in TINY_MODELS:  # its `length` counts text tokens (a VLM's ids also hold the image tokens)
        default_batch, default_length = TINY_MODELS[spec].sample_shape
        batch, length = batch_size or default_batch, sequence_length or default_length
    else:
        task = _folder_task(Path(spec), canonical_task(task), trust_remote_code)
        if task in NON_TEXT_TASKS:  # `length` counts text tokens, as `sample_inputs` takes it
            batch = next(iter(inputs.values())).shape[0]
            length = sequence_length or DEFAULT_TEXT_LENGTH.get(task, 0)
        else:
            batch, length = inputs["input_ids"].shape
    variants = {"grown": (batch, length + 3), "long": (batch, 4 * length + 1), "batch+1": (batch + 1, length)}
    if not length:  # no text axis (an image classifier): only another batch
        variants = {"batch+1": (batch + 1, 0)}
    sample_shapes = {k: tuple(v.shape) for k, v in inputs.items()}
    others = {}
    for name, (b, n) in variants.items():
        feed = sample_inputs(
            spec,
            seed=1,
            dtype=dtype,
            batch_size=b,
            sequence_length=n or None,
            trust_remote_code=trust_remote_code,
            task=task,
        )
        feed = {k: v for k, v in feed.items() if k in inputs}  # what the sample kept (see drop_untaken)
        if {k: tuple(v.shape) for k, v in feed.items()} != sample_shapes:
            others[name] = feed
    return others


def split(values: list[str] | None) -> tuple[str, ...]:
    """`--disable a,b --disable c` -> ("a", "b", "c")."""
    return tuple(v.strip() for value in values or () for v in value.split(",") if v.strip())
