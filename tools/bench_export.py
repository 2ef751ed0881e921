"""Export-time and run-time benchmark: hfexport vs transformers' own exporter vs eager, in one run.

    python tools/bench_export.py --models llama,qwen3_moe,gpt2 --repeat 3

For each corpus model: export with `hfexport.DynamoExporter` and with `transformers.exporters.DynamoExporter`
(the peer; imported here only, never from hfexport), `dynamic=True`, best of `--repeat` exports in this
process; then the per-call latency of `program.module()` for each, and of eager. Prints ratios measured side
by side, so machine load affects both sides alike. Times are wall clock on whatever machine runs it.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def _best(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    """Best wall time of `repeat` calls, and the last result."""
    times, result = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return min(times), result


def _latency(fn: Callable[[], Any], calls: int) -> float:
    """Median seconds per call, after one warm-up call."""
    with torch.no_grad():
        fn()
        samples = []
        for _ in range(calls):
            start = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def _peer_program(exported: Any) -> Any:
    # transformers' exporter wraps the program in an ExportedModel with one "model" component.
    if hasattr(exported, "module"):
        return exported
    return exported.components["model"].program


def bench_one(path: Path, repeat: int, calls: int, peer: Any) -> str:
    import hfexport
    from hfexport.testing.corpus import load_entry

    entry = load_entry(path)
    model, inputs = entry.build_model(), entry.sample_inputs()
    ours_s, ours = _best(
        lambda: hfexport.DynamoExporter().export(model, inputs, hfexport.DynamoConfig(dynamic=True)), repeat
    )
    peer_s, theirs, note = float("nan"), None, ""
    if peer is not None:
        try:
            peer_s, exported = _best(
                lambda: peer.DynamoExporter().export(model, inputs, config=peer.DynamoConfig(dynamic=True)), repeat
            )
            theirs = _peer_program(exported)
        except Exception as exc:  # the peer failing is a result too
            note = f"peer failed: {type(exc).__name__}"
    # `.module()` builds a new GraphModule: build once, time the calls.
    ours_module = ours.module()
    ours_ms = 1e3 * _latency(lambda: ours_module(**inputs), calls)
    peer_ms = float("nan")
    if theirs is not None:
        peer_module = theirs.module()
        peer_ms = 1e3 * _latency(lambda: peer_module(**inputs), calls)
    eager_ms = 1e3 * _latency(lambda: model(**inputs), calls)
    cells = [entry.model_type, f"{ours_s:.2f}", f"{peer_s:.2f}", f"{peer_s / ours_s:.2f}"]
    cells += [f"{ours_ms:.2f}", f"{peer_ms:.2f}", f"{eager_ms:.2f}", note]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama,qwen3_moe,gpt2,falcon_mamba")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    root = Path(__file__).resolve().parents[1] / "tests/fixtures/corpus/causal_lm"
    try:
        from transformers import exporters as peer
    except ImportError:
        peer = None
    print("| model | ours export s | peer export s | peer/ours | ours run ms | peer run ms | eager run ms | note |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        print(bench_one(root / f"{name}.json", args.repeat, args.calls, peer), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
