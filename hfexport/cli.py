"""The `hfexport` command (also `python -m hfexport`).

hfexport export --model tiny-llama --format dynamo --output out/
hfexport rules list [--stage fx] [--backend onnx]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any


def _load_model(spec: str) -> tuple[Any, dict[str, Any]]:
    from hfexport.tiny import TINY_MODELS

    if spec in TINY_MODELS:
        tiny = TINY_MODELS[spec]
        return tiny.build(), tiny.sample_inputs()
    path = Path(spec)
    if not path.is_dir():
        raise SystemExit(f"--model {spec!r} is neither a built-in ({', '.join(TINY_MODELS)}) nor a local model folder")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    inputs = tokenizer(["Hello, world!", "Export me"], padding=True, return_tensors="pt")
    return model, {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}


def _step(message: str) -> float:
    print(f"• {message}", file=sys.stderr, flush=True)
    return time.perf_counter()


def cmd_export(args: argparse.Namespace) -> int:
    import torch

    from hfexport.auto import AutoExportConfig, AutoHfExporter

    output = Path(args.output)
    if output.exists() and any(output.iterdir()) and not args.overwrite:
        raise SystemExit(f"{output} exists and is not empty; pass --overwrite to replace its contents")
    start = _step(f"building {args.model}")
    model, inputs = _load_model(args.model)
    config = AutoExportConfig.from_dict({"export_format": args.format, "dynamic": args.dynamic})
    exporter = AutoHfExporter.from_config(config)
    _step(f"exporting {type(model).__name__} to {args.format} (dynamic={args.dynamic})")
    program = exporter.export(model, inputs, config=config)
    output.mkdir(parents=True, exist_ok=True)
    _step(f"saving to {output}/")
    artifact = output / "model.pt2"
    torch.export.save(program, artifact)
    exporter.report.save(output / "report.json")
    manifest = {
        "format": args.format,
        "files": [artifact.name, "report.json"],
        "inputs": list(inputs),
        "config": config.to_dict(),
        "versions": exporter.report.versions,
    }
    (output / "manifest.json").write_text(json.dumps(manifest, indent=2))
    if args.validate:
        with torch.no_grad():
            expected = model(**inputs)[0]
            actual = program.module()(**inputs)[0]
        diff = (expected - actual).abs().max().item()
        exporter.report.parity = {"output0": diff}
        tolerance = 1e-3 * max(1.0, expected.abs().max().item())
        if diff > tolerance:
            print(exporter.report)
            print(f"validation failed: max abs diff {diff:.3g} > {tolerance:.3g}", file=sys.stderr)
            return 1
    print(exporter.report)
    print(f"done in {time.perf_counter() - start:.1f}s: {artifact}")
    return 0


def cmd_rules_list(args: argparse.Namespace) -> int:
    from hfexport.rewrites.engine import default_registry

    rules = [r for r in default_registry().rules(args.stage) if args.backend is None or args.backend in r.meta.backends]
    for rule in rules:
        meta = rule.meta
        print(f"{meta.id:45s} {meta.kind:12s} {','.join(meta.backends):30s} {meta.why}")
    print(f"{len(rules)} rule(s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hfexport", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    export = sub.add_parser("export", help="export a model and print the rule report")
    export.add_argument("--model", required=True, help="built-in tiny model name or a local model folder")
    export.add_argument("--format", default="dynamo", help="export format (default: dynamo)")
    export.add_argument("--output", required=True, help="folder for the artifact, report and manifest")
    export.add_argument("--dynamic", action=argparse.BooleanOptionalAction, default=True)
    export.add_argument("--validate", action="store_true", help="compare the artifact with eager")
    export.add_argument("--overwrite", action="store_true", help="replace a non-empty output folder")
    export.set_defaults(func=cmd_export)
    rules = sub.add_parser("rules", help="list the registered rewrite rules")
    rules_sub = rules.add_subparsers(dest="rules_command", required=True)
    listing = rules_sub.add_parser("list")
    listing.add_argument("--stage")
    listing.add_argument("--backend")
    listing.set_defaults(func=cmd_rules_list)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
