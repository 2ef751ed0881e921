"""Checks an export makes before it traces: each refuses a bad call with what to change, in milliseconds."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from hfexport.core.errors import ConfigError, InputError, OutputPathError

# generate kwargs that are model inputs, always tensors (others such as `forced_decoder_ids` may be lists).
_TENSOR_KWARGS = frozenset(
    {
        "input_ids",
        "attention_mask",
        "inputs_embeds",
        "pixel_values",
        "input_features",
        "decoder_input_ids",
        "decoder_attention_mask",
        "token_type_ids",
        "position_ids",
    }
)


# Caches whose tensors live elsewhere (offloaded: moved between devices on CUDA streams) or in a quantized
# store (optimum-quanto/HQQ kernels): none can be an input or output of an exported graph.
_UNEXPORTABLE_CACHE = re.compile(r"offloaded|quantized")


def check_generation_call(model: Any, generate_kwargs: Any, generation_config: Any = None) -> None:
    """Refuse, before `generate` runs, generate kwargs and cache settings that cannot be exported."""
    if not isinstance(generate_kwargs, Mapping) or not generate_kwargs:
        raise InputError("generate_kwargs must be a non-empty mapping, e.g. a tokenizer's BatchEncoding")
    for name, value in generate_kwargs.items():
        if name in _TENSOR_KWARGS and not isinstance(value, (torch.Tensor, type(None))):
            raise InputError(
                f"generate_kwargs[{name!r}] is a {type(value).__name__}, not a tensor; tokenize with "
                "return_tensors='pt' and pass the tensors"
            )
    config = generation_config if generation_config is not None else getattr(model, "generation_config", None)
    cache = getattr(config, "cache_implementation", None)
    if isinstance(cache, str) and _UNEXPORTABLE_CACHE.search(cache):
        raise ConfigError(
            f"cache_implementation={cache!r} cannot be exported (its tensors are offloaded or quantized outside the "
            "graph); use cache_implementation='static' for a fixed-size cache, or None for the dynamic cache"
        )
    max_cache_len = getattr(config, "max_cache_len", None)
    prompt = generate_kwargs.get("input_ids", generate_kwargs.get("inputs_embeds"))
    if isinstance(max_cache_len, int) and isinstance(prompt, torch.Tensor) and prompt.ndim >= 2:
        length = prompt.shape[1]
        if max_cache_len <= length:
            # transformers would silently grow the cache to fit; the export would then not have the asked size.
            raise InputError(
                f"max_cache_len={max_cache_len} leaves no room after the {length}-token prompt; set max_cache_len "
                f"to at least the prompt length plus max_new_tokens (here >= {length + 1}), or leave it None"
            )


def check_calibration_samples(quantizer: Any, sample_inputs: Mapping[str, Any]) -> None:
    """Refuse, before tracing, calibration samples (a list) that lack a tensor input of the export."""
    from hfexport.quantizers.base import CalibrationSet

    dataset = getattr(quantizer, "calibration_dataset", None)
    if isinstance(dataset, (list, tuple, Mapping, torch.Tensor, str)):
        # Its own checks (a single sample, a tensor, ...); only an iterator is not built here, as that would consume it.
        CalibrationSet(dataset, sample_inputs)
    if not isinstance(dataset, (list, tuple)) or not getattr(quantizer, "needs_calibration", True):
        return
    needed = [name for name, value in sample_inputs.items() if isinstance(value, torch.Tensor)]
    for index, sample in enumerate(dataset):
        if not isinstance(sample, Mapping):
            raise InputError(
                f"calibration sample {index} is a {type(sample).__name__}; each sample must be a mapping of forward "
                "argument names to tensors, like sample_inputs"
            )
        missing = [name for name in needed if name not in sample]
        if missing:
            raise InputError(
                f"calibration sample {index} lacks {missing}, tensor inputs of the export (its keys: "
                f"{sorted(map(str, sample))}); give every sample the keys of sample_inputs: {needed}"
            )


def _input_tensors(sample_inputs: Mapping[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """(input name, tensor) for every tensor of the sample inputs: plain, in pytrees, in a transformers Cache."""
    from transformers.cache_utils import Cache

    from hfexport.core.cache_pytree import flatten_cache

    for name, value in sample_inputs.items():
        if isinstance(value, torch.Tensor):
            yield name, value
        elif isinstance(value, Cache):
            yield from ((name, leaf) for leaf in flatten_cache(value)[0] if isinstance(leaf, torch.Tensor))
        elif isinstance(value, (tuple, list, Mapping)):
            leaves = torch.utils._pytree.tree_leaves(value)
            yield from ((name, leaf) for leaf in leaves if isinstance(leaf, torch.Tensor))


def check_devices(model: torch.nn.Module, sample_inputs: Mapping[str, Any], low_memory: bool = False) -> None:
    """Refuse, before tracing, a model without real weights or sample inputs on a device the model is not on.

    torch.export traces either without complaint (a `meta` or FakeTensor weight only has a shape), into a program
    that runs on no device: its weights and its inputs disagree, or it holds no weights at all. The low-memory
    export (`low_memory`) takes exactly such weights: FakeTensors, whose values it streams from the checkpoint.
    """
    from hfexport.frontends.empty_weights import is_empty

    named = [*model.named_parameters(), *model.named_buffers()]
    meta = [n for n, t in named if t.device.type == "meta"]
    empty = [n for n, t in named if is_empty(t)]
    if low_memory and meta:
        raise InputError(
            f"{len(meta)} weight(s) of {type(model).__name__} are on the meta device (e.g. {meta[0]!r}); the "
            "low-memory export takes FakeTensor weights on the CPU: build the model with "
            "hfexport.empty_model(checkpoint_folder)"
        )
    if empty and not low_memory:
        where = f"are on the meta device (e.g. {meta[0]!r})" if meta else f"are FakeTensors (e.g. {empty[0]!r})"
        raise InputError(
            f"{len(empty)} weight(s) of {type(model).__name__} {where}: they hold no values, so the exported program "
            "would compute nothing real; load the weights (from_pretrained without device_map='meta', or "
            "model.to_empty(device='cpu') and load a state dict) before exporting, or export a model too large "
            "for memory with OnnxConfig(low_memory=True)"
        )
    model_devices = {t.device for _, t in named}
    if not model_devices:
        return
    placed = ", ".join(sorted(map(str, model_devices)))
    for name, tensor in _input_tensors(sample_inputs):
        if tensor.device not in model_devices:
            raise InputError(
                f"sample input {name!r} is on {tensor.device}, the model on {placed}: the program would run on "
                f"neither; move the inputs to the model's device (e.g. {{k: v.to(model.device) for k, v in "
                "inputs.items()}) before exporting"
            )


def bfloat16_upcast(export_format: str, model: torch.nn.Module, sample_inputs: Mapping[str, Any]) -> str | None:
    """Why a bf16 model or bf16 sample inputs are exported computing in float32 for `export_format`, or None.

    A backend whose runtime has no bfloat16 kernels says so (`Backend.no_bfloat16`: ONNX Runtime's CPU provider);
    fp16 is kept, and bf16 where the runtime has bf16 kernels (ExecuTorch XNNPACK, OpenVINO CPU, torch).
    """
    from hfexport.backends.registry import find

    known = find(export_format)
    reason = known.no_bfloat16 if known is not None else ""
    if not reason:
        return None
    weights = any(t.dtype == torch.bfloat16 for t in (*model.parameters(), *model.buffers()))
    inputs = [name for name, t in _input_tensors(sample_inputs) if t.dtype == torch.bfloat16]
    if not weights and not inputs:
        return None
    what = "the model's bfloat16 weights" if weights else f"the bfloat16 inputs {sorted(set(inputs))}"
    return (
        f"{reason}: {what} are exported as float32, and the graph computes in float32 (its results differ from "
        "eager bf16 by bf16 rounding; the caller's model is unchanged); pass model.half() for a float16 file"
    )


def check_output_path(output_path: str | os.PathLike[str]) -> None:
    """Refuse, before tracing, an `output_path` that cannot be written: a folder, or under a file or a read-only
    folder. An existing file is replaced (atomically, when the export succeeds)."""
    path = Path(output_path)
    if path.is_dir():
        raise OutputPathError(
            f"output_path {str(path)!r} is a folder; name the model file in it (e.g. {path}/model...)"
        )
    parent = path.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise OutputPathError(
            f"output_path {str(path)!r} cannot be created: {str(parent)!r} is a file, not a folder; choose another path"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputPathError(f"output_path {str(path)!r} cannot be written: no write permission in {str(parent)!r}")


def preflight(
    exporter: Any, model: Any, sample_inputs: Mapping[str, Any], config: Any
) -> tuple[Any, dict[str, str], list[str]]:
    """Every check an export makes before tracing, in order: a bad call fails in milliseconds, the model untouched.

    Returns the config to use (the exporter's default when None, with defaults a quantizer needs filled in), the
    package versions found, and notes on the defaults chosen (for the report).
    """
    from hfexport.frontends.torch_export import check_attention_implementation, validate_inputs
    from hfexport.rewrites.engine import default_registry

    config = exporter.check_config(config)
    if not isinstance(model, torch.nn.Module):
        raise InputError(f"model must be a torch.nn.Module (a PreTrainedModel), got {type(model).__name__}")
    validate_inputs(sample_inputs, getattr(config, "dynamic_shapes", None))
    check_attention_implementation(model)
    check_devices(model, sample_inputs, low_memory=bool(getattr(config, "low_memory", False)))
    versions = exporter.validate_environment()
    default_registry().validate_selection(config.rules)
    output_path = getattr(config, "output_path", None)
    if output_path is not None:
        check_output_path(output_path)
    quantizer = getattr(config, "quantizer", None)
    notes: list[str] = []
    if quantizer is not None:
        config, notes = quantizer_defaults(quantizer, config)
        # Before tracing: a quantizer that does not fit the format, or lacks its packages, fails in milliseconds.
        from hfexport.quantizers.apply import check_quantizer

        versions = {**versions, **check_quantizer(quantizer, exporter.export_format, config)}
        check_calibration_samples(quantizer, sample_inputs)
    return config, versions, notes


def quantizer_defaults(quantizer: Any, config: Any) -> tuple[Any, list[str]]:
    """Fill what the caller left unset with what the quantizer needs (the ONNX opset), saying so.

    A documented recipe (`OnnxConfig(quantizer=NNCFOnnxQuantizer(...))`) must work with the config's defaults;
    only an explicit choice that conflicts is refused (by the quantizer's `check_config`).
    """
    import dataclasses

    newest = quantizer.newest_onnx_opset(config)
    # Only a config with an ONNX opset to choose (`opset_version`) has one to fill in.
    if newest is None or getattr(config, "opset_version", 0) is not None:
        return config, []
    from hfexport.lowerings.onnx import newest_opset

    opset = min(newest, newest_opset())
    note = f"opset_version={opset}: the newest opset {type(quantizer).__name__} works at (OnnxConfig left it unset)"
    return dataclasses.replace(config, opset_version=opset), [note]
