"""Bytes on disk and resident memory of a saved generation artifact: each weight once, against a folder per component.

    python tools/artifact_weights.py export DIR [--format onnx] [--model tiny|smollm2] [--layers 30] [--static]
    python tools/artifact_weights.py load DIR/once          # one fresh process per artifact

`export` runs `export_for_generation` once (a growing cache: a prefill and a decode graph; `--static`: a static
cache with multi-token decode, one graph for both) and saves the result twice: `DIR/once` (each weight once, the
default) and `DIR/per-component` (`save(..., weights_once=False)`: a folder per component, each with its own
weights, the layout hfexport wrote before). It prints the float weight bytes of the model and each artifact's bytes.
`load`, in a fresh process: `hfexport.load`, then `generate` of 8 new tokens from a 32-token prompt (batch 1);
prints the bytes of the model files, the process's peak RSS (VmHWM) after the imports, after `load` and after
`generate`, and its RssAnon / RssFile at the end (MB). The model: `tiny` is the built-in tiny-llama, `smollm2` the
SmolLM2-135M-shaped random Llama of `tools/bench_onnx.build_model` (hidden 576, 30 layers, tied embeddings).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

MB = 1 << 20


def _status() -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon, RssFile of this process, in bytes."""
    found = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            found[key] = int(value.split()[0]) * 1024
    return found


def _model(name: str, layers: int) -> Any:
    if name == "tiny":
        from hfexport.tiny import get_tiny_model

        return get_tiny_model("tiny-llama").build()
    from bench_onnx import build_model  # tools/ is on sys.path when this script runs

    return build_model(layers)


def _artifact_bytes(folder: Path) -> int:
    """Bytes of the files the components list, reports left out (the graphs and their weights, each file once)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    listed = {path for comp in manifest["components"].values() for path in comp["files"]}
    return sum(manifest["checksums"][p]["size"] for p in listed if not p.endswith("report.json"))


def export(args: argparse.Namespace) -> None:
    import torch
    from transformers import GenerationConfig

    import hfexport
    from hfexport.auto import AutoExportConfig, AutoHfExporter

    model = _model(args.model, args.layers)
    vocab = model.config.vocab_size
    ids = torch.randint(3, vocab, (2, 8), generator=torch.Generator().manual_seed(0))
    sample = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    config = AutoExportConfig.from_dict({"export_format": args.format, "dynamic": True})
    extra: dict[str, Any] = {}
    if args.static:
        extra = {"generation_config": GenerationConfig(cache_implementation="static", max_cache_len=64)}
        extra["multi_token_decode"] = True
    components = AutoHfExporter.from_config(config).export_for_generation(model, sample, config, **extra)
    out = Path(args.dir)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"float weights: {weights / MB:.1f} MB")
    for name, once in (("once", True), ("per-component", False)):
        folder = hfexport.save(components, out / name, weights_once=once, overwrite=True)
        print(f"{name}: {_artifact_bytes(folder) / MB:.1f} MB ({', '.join(sorted(components))})")


def load(args: argparse.Namespace) -> None:
    import torch

    import hfexport
    from hfexport.runtime.generation import generate

    folder = Path(args.dir)
    imported = _status()["VmHWM"]
    loaded = hfexport.load(folder)
    after_load = _status()["VmHWM"]
    ids = torch.randint(3, 100, (1, 32), generator=torch.Generator().manual_seed(1))
    generate(loaded, ids, max_new_tokens=8, min_new_tokens=8)
    end = _status()
    row = {
        "artifact": str(folder),
        "bytes_MB": round(_artifact_bytes(folder) / MB, 1),
        "peak_after_imports_MB": round(imported / MB),
        "peak_after_load_MB": round(after_load / MB),
        "peak_after_generate_MB": round(end["VmHWM"] / MB),
        "anon_MB": round(end["RssAnon"] / MB),
        "file_MB": round(end["RssFile"] / MB),
    }
    print(json.dumps(row))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    first = sub.add_parser("export")
    first.add_argument("dir")
    first.add_argument("--format", default="onnx")
    first.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    first.add_argument("--layers", type=int, default=30)
    first.add_argument("--static", action="store_true")
    second = sub.add_parser("load")
    second.add_argument("dir")
    args = parser.parse_args(argv)
    export(args) if args.command == "export" else load(args)


if __name__ == "__main__":
    sys.exit(main())
