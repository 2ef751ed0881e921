"""The export config the commands build from their arguments: `--format`, `--config` (inline JSON or a file),
`--opset`, `--portable`, `--device`, `--enable/--disable` and the `--quantize` recipes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from hfexport.backends.registry import backend, backends
from hfexport.cli.exits import UsageError
from hfexport.cli.models import split


def export_config(args: argparse.Namespace) -> Any:
    from hfexport.auto import AutoExportConfig

    data: dict[str, Any] = {"export_format": args.format, "dynamic": args.dynamic}
    data.update(config_json(args.config))
    if getattr(args, "opset", None) is not None:
        data["opset_version"] = _config_field(args.format, "--opset", "opset_version", args.opset)
    if getattr(args, "portable", False):
        data["fusions"] = _config_field(args.format, "--portable", "fusions", None)
    device = getattr(args, "device", None)
    if device and backend(args.format).device_at_export:
        # The device is part of the program (an ExecuTorch delegate), chosen when lowering: it sets the config.
        from hfexport.runtime.devices import resolve_device

        chosen = resolve_device(args.format, device)
        for key, value in backend(args.format).runtime.load().device_config(chosen).items():
            if data.get(key, value) != value:
                raise UsageError(f"--device {device} means {key} {value!r}, --config says {data[key]!r}: drop one")
            data[key] = value
    if getattr(args, "low_memory", False):
        data["low_memory"] = True
    if args.enable or args.disable:
        data["rules"] = {"enable": list(split(args.enable)), "disable": list(split(args.disable))}
    try:
        config = AutoExportConfig.from_dict(data)
    except (TypeError, ValueError) as exc:
        # Name the flag the value came from: --opset N is a config field too.
        flag = "--config"
        if getattr(args, "opset", None) is not None and "opset_version" in str(exc):
            flag = f"--opset {args.opset}"
        raise UsageError(f"{flag}: {exc}") from None
    if args.quantize:
        config.quantizer = _quantizer(args.quantize, args.format)
        config.quantizer.keep_float = split(getattr(args, "keep_float", None))
    from hfexport.rewrites.engine import default_registry

    try:
        default_registry().validate_selection(config.rules)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    return config


def _config_field(export_format: str, flag: str, field: str, value: Any) -> Any:
    """`value` for the config field a flag sets; a `UsageError` where the format's config has no such field."""
    if not hasattr(backend(export_format).config.load(), field):
        takes = " or ".join(b.name for b in backends() if hasattr(b.config.load(), field))
        raise UsageError(f"{flag} applies to --format {takes}, not {export_format}")
    return value


def config_json(value: str | None) -> dict[str, Any]:
    """`--config` as a dict: inline JSON or `@file.json`; a clear one-line error otherwise."""
    if not value:
        return {}
    try:
        text = Path(value[1:]).read_text() if value.startswith("@") else value
    except OSError as exc:
        raise UsageError(f"--config {value}: cannot read the file ({exc.strerror})") from None
    try:
        extra = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"--config is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno})") from None
    if not isinstance(extra, dict):
        raise UsageError("--config takes a JSON object, e.g. '{\"compress_to_fp16\": false}'")
    return extra


QUANTIZE_RECIPES = ("ort-dynamic", "ort-static", "pt2e-x86", "nncf-int8", "nncf-int4", "torchao-8da4w")
# The recipes a low-memory export applies while streaming (NNCF's data-free weight compression, ONNX and OpenVINO).
LOW_MEMORY_RECIPES = ("nncf-int4",)


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
    if recipe == "torchao-8da4w":
        return q.TorchAOQuantizer()
    # The NNCF quantizer of the format's own model where there is one (ONNX, OpenVINO), else NNCF on the FX graph.
    own = (q.NNCFOnnxQuantizer, q.NNCFOpenVINOQuantizer)
    nncf = next((cls for cls in own if export_format in map(str, cls.supported_formats)), q.NNCFTorchFXQuantizer)
    if recipe == "nncf-int8":
        return nncf(q.NNCFQuantizationConfig())
    if recipe == "nncf-int4":
        return nncf(q.NNCFWeightCompressionConfig(mode="int4_sym", group_size=32))
    raise UsageError(f"--quantize {recipe!r}: choose one of {', '.join(QUANTIZE_RECIPES)}")
