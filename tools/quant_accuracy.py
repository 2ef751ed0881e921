"""The accuracy table of docs/quantization.md: every quantization recipe on every backend, on the trained code model.

    nice -n 10 python tools/quant_accuracy.py [--json quant-accuracy.json] [--only onnx,ort-dynamic]
        [--no-generation] [--quick]

Each row exports the fixture `tests/fixtures/code_lm` (a 4-layer Llama trained on Python stdlib source,
`tools/train_code_lm.py`) with one recipe, through `export()` (one program, saved and run from the folder, as
`export --validate` does) and through `export_for_generation` (prefill and decode, run by `hfexport.runtime`),
and measures it against the float model with `hfexport.quantization_accuracy` on the fixture's `heldout.txt`
(16 windows of 128 tokens: 2032 next-token predictions; greedy generation from two 32-token prompts, 32 new
tokens): perplexity and its change, mean KL divergence, top-1 agreement, first greedy divergence. Recipes that
read data calibrate on 16 windows of 128 tokens of the training side of the stdlib split (never the held-out
text). A row that fails says why. `--quick`: the first recipe of each backend, `export()` only (a smoke run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "code_lm"
WINDOW = 128


@dataclass
class Recipe:
    backend: str
    name: str
    make: Callable[[list[dict[str, torch.Tensor]]], Any]  # calibration samples -> quantizer
    static: bool = False  # NNCF's Torch FX int8 reads static graphs only
    config: dict[str, Any] | None = None


def _xnnpack(**options: Any) -> Any:
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )

    return XNNPACKQuantizer().set_global(get_symmetric_quantization_config(**options))


def _x86() -> Any:
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )

    return X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())


def recipes() -> list[Recipe]:
    import nncf

    import hfexport.quantizers as q
    from hfexport.apps.bench import quantizer_for

    wc = q.NNCFWeightCompressionConfig
    int4 = wc(mode="int4_sym", group_size=32)
    rows = []
    for backend in ("onnx", "openvino", "executorch", "dynamo"):
        rows += [
            Recipe(backend, "bench int8", lambda cal, b=backend: quantizer_for(b, "int8")),
            Recipe(backend, "bench int4", lambda cal, b=backend: quantizer_for(b, "int4")),
        ]
    rows += [
        Recipe("onnx", "OnnxRuntime static int8", lambda cal: q.OnnxRuntimeQuantizer(calibration_dataset=cal)),
        Recipe(
            "onnx",
            "NNCFOnnx int8",
            lambda cal: q.NNCFOnnxQuantizer(calibration_dataset=cal),
            config={"opset_version": 20},
        ),
        Recipe("onnx", "NNCFOnnx int8_asym weights", lambda cal: q.NNCFOnnxQuantizer(wc())),
        Recipe("onnx", "NNCFOnnx int4_sym g32", lambda cal: q.NNCFOnnxQuantizer(int4)),
        Recipe("onnx", "PT2E X86Inductor int8", lambda cal: q.PT2EQuantizer(_x86(), cal)),
        Recipe("onnx", "NNCFTorchFX int4_sym g32", lambda cal: q.NNCFTorchFXQuantizer(int4)),
        Recipe("openvino", "NNCFOpenVINO int8", lambda cal: q.NNCFOpenVINOQuantizer(calibration_dataset=cal)),
        Recipe("openvino", "NNCFOpenVINO int8_asym weights", lambda cal: q.NNCFOpenVINOQuantizer(wc())),
        Recipe("openvino", "NNCFOpenVINO int4_sym g32", lambda cal: q.NNCFOpenVINOQuantizer(int4)),
        Recipe(
            "openvino",
            "NNCFOpenVINO int4_sym g32 AWQ + scale estimation",
            lambda cal: q.NNCFOpenVINOQuantizer(
                wc(mode="int4_sym", group_size=32, awq=True, scale_estimation=True), calibration_dataset=cal
            ),
        ),
        Recipe(
            "openvino",
            "NNCFOpenVINO int4_sym g32 ratio 0.8 (NNCF's mixed precision)",
            lambda cal: q.NNCFOpenVINOQuantizer(
                wc(
                    mode="int4_sym",
                    group_size=32,
                    ratio=0.8,
                    sensitivity_metric=nncf.SensitivityMetric.HESSIAN_INPUT_ACTIVATION,
                ),
                calibration_dataset=cal,
            ),
        ),
        Recipe("openvino", "PT2E X86Inductor int8", lambda cal: q.PT2EQuantizer(_x86(), cal)),
        Recipe(
            "openvino", "NNCFTorchFX int8", lambda cal: q.NNCFTorchFXQuantizer(calibration_dataset=cal), static=True
        ),
        Recipe(
            "executorch",
            "PT2E XNNPACK int8 (static, per tensor)",
            lambda cal: q.PT2EQuantizer(_xnnpack(), cal),
        ),
        Recipe("executorch", "NNCFTorchFX int4_sym g32", lambda cal: q.NNCFTorchFXQuantizer(int4)),
        Recipe("executorch", "TorchAO 8da4w g32", lambda cal: q.TorchAOQuantizer()),
        Recipe("dynamo", "PT2E X86Inductor int8", lambda cal: q.PT2EQuantizer(_x86(), cal)),
        Recipe("dynamo", "NNCFTorchFX int8", lambda cal: q.NNCFTorchFXQuantizer(calibration_dataset=cal), static=True),
    ]
    order = {"onnx": 0, "openvino": 1, "executorch": 2, "dynamo": 3}
    return sorted(rows, key=lambda r: order[r.backend])


def calibration(tokenizer: Any, batch: int, count: int = 16) -> list[dict[str, torch.Tensor]]:
    """`count` samples of `batch` x WINDOW tokens from the training side of the stdlib split (path order)."""
    from hfexport.artifacts.eval_text import read_stdlib

    corpus = read_stdlib()
    ids: list[int] = []
    for name in corpus.train[::7]:
        ids += tokenizer(corpus.texts[name], add_special_tokens=False)["input_ids"]
        if len(ids) >= count * batch * WINDOW:
            break
    tensor = torch.tensor(ids[: count * batch * WINDOW]).view(count, batch, WINDOW)
    return [{"input_ids": t, "attention_mask": torch.ones_like(t)} for t in tensor]


def run_row(recipe: Recipe, generation: bool, model: Any, tokenizer: Any, text: str) -> dict[str, Any]:
    import tempfile

    import hfexport
    from hfexport.artifacts.accuracy import quantization_accuracy
    from hfexport.auto import AutoExportConfig, AutoHfExporter
    from hfexport.quantizers.base import jsonable

    row: dict[str, Any] = {
        "backend": recipe.backend,
        "recipe": recipe.name,
        "path": "export_for_generation" if generation else "export",
    }
    if recipe.static and generation:
        row["error"] = "static shapes only (nncf.quantize on Torch FX): no generation components"
        return row
    length = WINDOW if recipe.static else 16
    sample = calibration(tokenizer, 2, 1)[0]
    sample = {k: v[:, :length].contiguous() for k, v in sample.items()}
    cal = calibration(tokenizer, 2 if recipe.static else 1)
    quantizer = recipe.make(cal)
    data = {"export_format": recipe.backend, "dynamic": not recipe.static, **(recipe.config or {})}
    if recipe.backend == "executorch":
        data["backend"] = "xnnpack"
    config = AutoExportConfig.from_dict(data)
    config.quantizer = quantizer
    exporter = AutoHfExporter.from_config(config)
    started = time.perf_counter()
    measure = {"windows": 16, "window": WINDOW, "greedy_prompt": 32, "greedy_tokens": 32}
    with tempfile.TemporaryDirectory(prefix="quant-accuracy-") as tmp:
        if generation:
            result = exporter.export_for_generation(model, sample, config)
        else:
            program = exporter.export(model, sample, config=config)
            result = Path(tmp) / "export"
            hfexport.save(program, result, config=config, report=exporter.report)
        row["export_seconds"] = round(time.perf_counter() - started, 1)
        record = quantization_accuracy(
            result,
            model,
            tokenizer=tokenizer,
            text=text,
            text_name="heldout.txt",
            sample_inputs=sample,
            quantizer=quantizer,
            **measure,
        )
    row["settings"] = jsonable(quantizer.settings())
    row["accuracy"] = record.to_dict()
    return row


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| backend | recipe | path | precision | perplexity | change | KL | top-1 | greedy diverges |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        a = row.get("accuracy")
        path = "generation" if row["path"] == "export_for_generation" else "export"
        if a is None:
            lines.append(
                f"| {row['backend']} | {row['recipe']} | {path} | | failed: {row.get('error', '')[:120]} | | | | |"
            )
            continue
        first = a["first_divergence"]
        diverges = "never" if first is None else f"at {first}"
        if not a["greedy_tokens"]:
            diverges = "n/a"
        verdict = "" if a["ok"] else " ✗"
        lines.append(
            f"| {row['backend']} | {row['recipe']} | {path} | {a['precision']} | {a['perplexity']:.3f} | "
            f"{a['perplexity_change']:+.2%}{verdict} | {a['kl_divergence']:.4f} | {a['top1_agreement']:.1%} | "
            f"{diverges} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=FIXTURE, help="the model folder, with heldout.txt (the fixture)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--only", help="comma-separated backends or recipe names (substrings)")
    parser.add_argument("--no-generation", action="store_true", help="export() rows only")
    parser.add_argument("--quick", action="store_true", help="the first recipe of each backend, export() only")
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(args.model, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    text = (args.model / "heldout.txt").read_text()
    chosen = recipes()
    if args.only:
        keys = [k.strip() for k in args.only.split(",")]
        chosen = [r for r in chosen if any(k == r.backend or k in r.name for k in keys)]
    if args.quick:
        chosen = [next(r for r in chosen if r.backend == b) for b in dict.fromkeys(r.backend for r in chosen)]
    paths = [False] if args.no_generation or args.quick else [False, True]
    rows = []
    started = time.perf_counter()
    for generation in paths:  # every export() row first, then the generation rows
        for recipe in chosen:
            label = f"{recipe.backend} / {recipe.name} / {'generation' if generation else 'export'}"
            print(f"--- {label}", file=sys.stderr, flush=True)
            try:
                row = run_row(recipe, generation, model, tokenizer, text)
            except Exception as exc:
                traceback.print_exc()
                first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
                row = {
                    "backend": recipe.backend,
                    "recipe": recipe.name,
                    "path": "export_for_generation" if generation else "export",
                    "error": f"{type(exc).__name__}: {first}",
                }
            rows.append(row)
            accuracy = row.get("accuracy")
            print(f"    {json.dumps(accuracy or row.get('error'))[:400]}", file=sys.stderr, flush=True)
            if args.json:
                args.json.write_text(json.dumps(_document(rows, started), indent=2) + "\n")
    print(table(rows))
    print(f"{len(rows)} rows in {(time.perf_counter() - started) / 60:.1f} min")
    return 0


def _document(rows: list[dict[str, Any]], started: float) -> dict[str, Any]:
    import importlib.metadata as md

    versions = {}
    for name in ("torch", "transformers", "nncf", "onnxruntime", "openvino", "executorch", "torchao"):
        with contextlib.suppress(md.PackageNotFoundError):
            versions[name] = md.version(name)
    return {
        "model": "tests/fixtures/code_lm",
        "text": "tests/fixtures/code_lm/heldout.txt",
        "python": platform.python_version(),
        "versions": versions,
        "minutes": round((time.perf_counter() - started) / 60, 1),
        "rows": rows,
    }


if __name__ == "__main__":
    sys.exit(main())
