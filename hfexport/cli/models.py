"""What the commands build from their arguments: the model (a built-in tiny one or a local folder), the
export config (`--format`, `--config`, `--enable/--disable`, `--quantize`)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

# --task -> the transformers Auto class a local model folder is loaded with.
TASKS: dict[str, str] = {
    "causal-lm": "AutoModelForCausalLM",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
    "feature-extraction": "AutoModel",
    "sequence-classification": "AutoModelForSequenceClassification",
    "masked-lm": "AutoModelForMaskedLM",
}


def _task_class(path: Path, task: str) -> Any:
    """The Auto class for `task`; `auto` reads the folder's config (`architectures`) to choose."""
    import transformers

    if task == "auto":
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        architecture = (getattr(config, "architectures", None) or [""])[0]
        suffixes = {
            "ForCausalLM": "causal-lm",
            "ForConditionalGeneration": "seq2seq-lm",
            "ForSequenceClassification": "sequence-classification",
            "ForMaskedLM": "masked-lm",
        }
        task = next((t for suffix, t in suffixes.items() if architecture.endswith(suffix)), "feature-extraction")
    return getattr(transformers, TASKS[task])


def load_model(spec: str, task: str = "auto") -> tuple[Any, dict[str, Any]]:
    from hfexport.tiny import TINY_MODELS

    if spec in TINY_MODELS:
        tiny = TINY_MODELS[spec]
        return tiny.build(), tiny.sample_inputs()
    path = Path(spec)
    if not path.is_dir():
        raise SystemExit(f"--model {spec!r} is neither a built-in ({', '.join(TINY_MODELS)}) nor a local model folder")
    import torch
    from transformers import AutoTokenizer

    model = _task_class(path, task).from_pretrained(path, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    inputs = tokenizer(["Hello, world!", "Export me"], padding=True, return_tensors="pt")
    return model, {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}


def split(values: list[str] | None) -> tuple[str, ...]:
    """`--disable a,b --disable c` -> ("a", "b", "c")."""
    return tuple(v.strip() for value in values or () for v in value.split(",") if v.strip())


def export_config(args: argparse.Namespace) -> Any:
    from hfexport.auto import AutoExportConfig

    data: dict[str, Any] = {"export_format": args.format, "dynamic": args.dynamic}
    if args.config:
        text = Path(args.config[1:]).read_text() if args.config.startswith("@") else args.config
        extra = json.loads(text)
        if not isinstance(extra, dict):
            raise SystemExit("--config takes a JSON object, e.g. '{\"compress_to_fp16\": false}'")
        data.update(extra)
    if args.enable or args.disable:
        data["rules"] = {"enable": list(split(args.enable)), "disable": list(split(args.disable))}
    config = AutoExportConfig.from_dict(data)
    if args.quantize:
        config.quantizer = _quantizer(args.quantize, args.format)
    from hfexport.rewrites.engine import default_registry

    default_registry().validate_selection(config.rules)
    return config


QUANTIZE_RECIPES = ("ort-dynamic", "ort-static", "pt2e-x86", "nncf-int8", "nncf-int4")


def _quantizer(recipe: str, export_format: str) -> Any:
    """The quantizer of a `--quantize` recipe for a format (the export checks the pair before tracing)."""
    import hfexport.quantizers as q

    if recipe == "ort-dynamic":
        return q.OnnxRuntimeQuantizer(q.OnnxRuntimeDynamicConfig())
    if recipe == "ort-static":
        return q.OnnxRuntimeQuantizer(q.OnnxRuntimeStaticConfig())
    if recipe == "pt2e-x86":
        from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
            X86InductorQuantizer,
            get_default_x86_inductor_quantization_config,
        )

        return q.PT2EQuantizer(X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config()))
    nncf = {"onnx": q.NNCFOnnxQuantizer, "openvino": q.NNCFOpenVINOQuantizer}.get(export_format, q.NNCFTorchFXQuantizer)
    if recipe == "nncf-int8":
        return nncf(q.NNCFQuantizationConfig())
    if recipe == "nncf-int4":
        return nncf(q.NNCFWeightCompressionConfig(mode="int4_sym", group_size=32))
    raise SystemExit(f"--quantize {recipe!r}: choose one of {', '.join(QUANTIZE_RECIPES)}")
