"""Export time of `export_for_generation` (static cache, multi-token decode): hfexport against the peer.

Issue #19 goal 5 asks for <= 0.8x the peer (`transformers.exporters`) on Dynamo and <= 0.5x on ONNX. Each export
runs in a fresh process (imports and caches not shared), ours and the peer's alternated round by round so that a
change of machine load hits both; the table gives the medians, their ratio and each export's peak RSS.

    python tools/bench_export_time.py [--layers 4] [--rounds 3] [--formats dynamo,onnx]

The model is the SmolLM2-135M shape (random weights, `tools/bench_onnx.py`) cut to `--layers`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

_CHILD = r"""
import json, logging, sys, time, warnings
warnings.filterwarnings("ignore")
logging.disable(logging.WARNING)
sys.path.insert(0, {tools!r})
import torch
from transformers import GenerationConfig
from bench_onnx import build_model
from hfexport.apps.bench import PeakRss

side, fmt, layers = {side!r}, {fmt!r}, {layers}
if side == "peer":
    import transformers.exporters as package
else:
    import hfexport as package
exporter_class = {{"dynamo": "DynamoExporter", "onnx": "OnnxExporter"}}[fmt]
config_class = {{"dynamo": "DynamoConfig", "onnx": "OnnxConfig"}}[fmt]
model = build_model(layers)
ids = torch.randint(3, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(1))
sample = {{"input_ids": ids, "attention_mask": torch.ones_like(ids)}}
static = GenerationConfig(cache_implementation="static", max_cache_len=256)
exporter = getattr(package, exporter_class)()
start = time.perf_counter()
with PeakRss() as memory:
    exporter.export_for_generation(
        model, sample, getattr(package, config_class)(dynamic=True), generation_config=static, multi_token_decode=True
    )
print(json.dumps({{"seconds": time.perf_counter() - start, "peak_mb": memory.megabytes}}))
"""


def _run(side: str, fmt: str, layers: int) -> dict[str, float]:
    code = _CHILD.format(tools=str(Path(__file__).parent), side=side, fmt=fmt, layers=layers)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode or not lines:
        return {"error": (done.stderr.strip().splitlines() or ["no output"])[-1]}
    return json.loads(lines[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--formats", default="dynamo,onnx")
    args = parser.parse_args(argv)
    load_start = os.getloadavg()[0]
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for fmt in args.formats.split(","):
        for round_ in range(args.rounds):
            # Alternate which side goes first, so neither always follows the other's page-cache warm-up.
            for side in ("ours", "peer") if round_ % 2 == 0 else ("peer", "ours"):
                result = _run(side, fmt, args.layers)
                results.setdefault((fmt, side), []).append(result)
                print(f"• {fmt} {side} round {round_ + 1}: {result}", file=sys.stderr, flush=True)
    print(
        f"SmolLM2-135M shape, {args.layers} layers; {args.rounds} rounds alternated; "
        f"load {load_start:.1f} -> {os.getloadavg()[0]:.1f}"
    )
    print("| format | ours s (median) | peer s (median) | ours / peer | ours peak MB | peer peak MB |")
    print("|---|---|---|---|---|---|")
    for fmt in args.formats.split(","):
        cells = []
        for side in ("ours", "peer"):
            ok = [r for r in results[(fmt, side)] if "seconds" in r]
            cells.append(
                (statistics.median(r["seconds"] for r in ok), max(r["peak_mb"] for r in ok)) if ok else (None, None)
            )
        (ours, ours_mb), (peer, peer_mb) = cells
        ratio = f"{ours / peer:.2f}" if ours and peer else "n/a"

        def show(value: float | None) -> str:
            return "failed" if value is None else f"{value:.1f}"

        print(f"| {fmt} | {show(ours)} | {show(peer)} | {ratio} | {show(ours_mb)} | {show(peer_mb)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
