"""Where ExecuTorch spends its time: the export's stages, and the decode step by kernel family (`perf`).

    python tools/profile_executorch.py [--precision {fp32,int8,int4}] [--layers 8] [--prompt 128] [--new 32]
        [--rounds 3] [--export-profile 25] [--json FILE]

The model, export and loop are `tools/bench_generate.py`'s (through `profile_generate.export_like_bench`): the
SmolLM2-135M-shaped Llama (random weights, seed 0) cut to `--layers`, `export_for_generation` with a static cache
of `--cache` slots and one multi-token decode graph, `hfexport.apps.bench.quantizer_for`'s ExecuTorch recipe, run by
`hfexport.runtime.generate`.

Why `perf` and not ExecuTorch's profiler: the executorch wheel's runtime is built without the event tracer
(ETDump needs EXECUTORCH_ENABLE_EVENT_TRACER), while its XNNPACK micro-kernels and portable kernels keep their
symbols. `perf record` samples this process at a fixed rate, once over `--rounds` prompt-only generations (1 new
token) and once over `--rounds` generations of `--new` tokens; the decode steps' samples per symbol are the
difference, so a symbol's share of the decode is its share of the decode steps' time, prefill excluded. Symbols are
grouped into families (`FAMILIES`): XNNPACK's micro-kernels (named where the build keeps their symbols; the pip
wheel's are unnamed addresses of its runtime library), the pthreadpool workers, torch's OpenMP runtime, memory
copies, ExecuTorch's kernels outside the delegate, libtorch (the Python runtime's tensors in and out), Python, the
OS kernel.

`--export-profile N` runs the export under cProfile and prints the N functions with the most cumulative time
among those that name a stage of torch.export, PT2E quantization or ExecuTorch's lowering. Stage seconds per
component (the export report's) are printed in every run.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import json
import os
import pstats
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from profile_generate import export_like_bench  # tools/ is on sys.path when this script runs

from hfexport.apps.bench import PRECISION_BITS, timed, weight_bytes_per_token

# (family, test on (dso, symbol)), first match wins: the order matters (a qd8 GEMM is a GEMM, not a conversion).
FAMILIES: list[tuple[str, Any]] = [
    ("xnnpack gemm (weights)", lambda dso, sym: sym.startswith("xnn_") and "gemm" in sym),
    ("xnnpack int8 activation conversion", lambda dso, sym: sym.startswith("xnn_") and "qd8" in sym),
    # The pip wheel strips the micro-kernels' symbols: unnamed code of the runtime library is XNNPACK's kernels
    # (the portable kernels and the runtime keep their names).
    ("executorch library, unnamed (XNNPACK micro-kernels)", lambda dso, sym: "portable_lib" in dso and sym[:2] == "0x"),
    ("xnnpack other", lambda dso, sym: sym.startswith("xnn_") or "XNNPACK" in sym or "xnnpack" in sym),
    # ExecuTorch's pthreadpool calls resolve to the copy libtorch exports: its workers are XNNPACK's threads.
    ("pthreadpool workers (XNNPACK's threads)", lambda dso, sym: sym == "thread_main" or "pthreadpool" in sym),
    ("torch's OpenMP runtime (libgomp)", lambda dso, sym: dso.startswith("libgomp")),
    ("memory copies", lambda dso, sym: re.search(r"mem(move|cpy|set)|copy_kernel", sym) is not None),
    ("executorch kernels outside the delegate", lambda dso, sym: "executor" in sym),
    ("libtorch / c10", lambda dso, sym: dso.startswith(("libtorch", "libc10"))),
    ("python", lambda dso, sym: "python" in dso),
    ("os kernel", lambda dso, sym: dso.startswith("[kernel")),
    ("other", lambda dso, sym: True),
]
# Functions whose cumulative time `--export-profile` lists (substrings of "file:function").
EXPORT_STAGES = (
    "export_for_generation",
    "torch/export/_trace.py:_export",
    "run_decompositions",
    "prepare_pt2e",
    "convert_pt2e",
    "to_edge_transform_and_lower",
    "_gen_edge_manager_for_partitioners",
    "partition",
    "to_backend",
    "create_submodule_from_nodes",
    "legalize_graph",
    "recompile",
    "preprocess",
    "to_executorch",
    "quantize",
    "apply_rules",
)


def perf_samples(action: Any, rounds: int, frequency: int = 999) -> collections.Counter[tuple[str, str]]:
    """Samples per (dso, symbol) of this process while `action()` runs `rounds` times."""
    with tempfile.TemporaryDirectory() as tmp:
        data = str(Path(tmp) / "perf.data")
        perf = subprocess.Popen(
            ["perf", "record", "-q", "-F", str(frequency), "-p", str(os.getpid()), "-o", data],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        time.sleep(0.5)  # perf attaches before the first call
        for _ in range(rounds):
            action()
        perf.send_signal(signal.SIGINT)
        perf.wait(timeout=60)
        report = subprocess.run(
            ["perf", "report", "-i", data, "--stdio", "-q", "-n", "--no-children", "--sort", "dso,symbol"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    for line in report.splitlines():
        # "  12.3%  456  libfoo.so  [.] symbol   -  -": the trailing dashes are perf's empty extra columns.
        match = re.match(r"\s*[\d.]+%\s+(\d+)\s+(\S+)\s+\[.\]\s+(.*?)(?:\s+-\s+-)?\s*$", line)
        if match:
            counts[match.group(2), match.group(3)] += int(match.group(1))
    return counts


def family(dso: str, sym: str) -> str:
    return next(name for name, test in FAMILIES if test(dso, sym))


def families(samples: collections.Counter[tuple[str, str]]) -> collections.Counter[str]:
    """Samples per (dso, symbol) summed by family."""
    by_family: collections.Counter[str] = collections.Counter()
    for (dso, sym), count in samples.items():
        by_family[family(dso, sym)] += count
    return by_family


def export_profile(stats: pstats.Stats, top: int) -> list[tuple[str, float]]:
    """The `top` functions naming an export stage, by cumulative seconds."""
    rows = []
    for (path, _, name), (_, _, _, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{path}:{name}"
        if any(stage in where for stage in EXPORT_STAGES):
            rows.append((where.split("site-packages/")[-1], cumulative))
    return sorted(rows, key=lambda row: -row[1])[:top]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", choices=tuple(PRECISION_BITS), default="int4")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--cache", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--export-profile", type=int, default=0, help="cProfile the export; list this many stages")
    parser.add_argument("--json", help="write the figures to this file")
    args = parser.parse_args(argv)

    from hfexport.runtime.generation import generate

    load_start = os.getloadavg()[0]
    profiler = cProfile.Profile() if args.export_profile else None
    if profiler is not None:
        profiler.enable()
    model, ids, exporter, components, export_s, bandwidth = export_like_bench(
        "executorch", args.precision, args.layers, args.prompt, args.cache
    )
    if profiler is not None:
        profiler.disable()
    stages = {name: dict(report.stage_seconds) for name, report in exporter.reports.items()}
    print(f"export {export_s:.0f} s; stage seconds per component: {json.dumps(stages)}", flush=True)
    slow = export_profile(pstats.Stats(profiler), args.export_profile) if profiler is not None else []
    for where, seconds in slow:
        print(f"  {seconds:8.1f} s  {where}")

    mask = ids.new_ones(ids.shape)

    def run(n: int) -> Any:
        return generate(components, ids, mask, max_new_tokens=n, min_new_tokens=n)

    run(args.new)  # warm-up
    ttft, tokens_per_s = timed(run, args.new, args.rounds)
    prefill = perf_samples(lambda: run(1), args.rounds)
    whole = perf_samples(lambda: run(args.new), args.rounds)
    decode = collections.Counter({key: whole[key] - prefill[key] for key in whole if whole[key] > prefill[key]})
    total = sum(decode.values())
    step_ms = 1e3 / tokens_per_s
    by_family = families(decode)
    # The prompt's call (TTFT) by family too: a 1-token generate is the prefill alone.
    prefill_families = families(prefill)
    prefill_total = max(sum(prefill_families.values()), 1)
    weights = weight_bytes_per_token(model) * PRECISION_BITS[args.precision] / 32
    # XNNPACK's kernels, named or not: the GEMMs that stream the weights and the little else XNNPACK runs.
    kernels = by_family["xnnpack gemm (weights)"] + by_family["executorch library, unnamed (XNNPACK micro-kernels)"]
    gemm_ms = max(step_ms * kernels / max(total, 1), 1e-9)
    load_end = os.getloadavg()[0]

    print()
    print(
        f"executorch {args.precision}, {args.layers} layers, prompt {args.prompt}, {args.new} new tokens, cache "
        f"{args.cache}; load {load_start:.1f} -> {load_end:.1f}; matvec {bandwidth / 1e9:.1f} GB/s"
    )
    print(
        f"TTFT {ttft * 1e3:.0f} ms; decode {tokens_per_s:.1f} tok/s ({step_ms:.2f} ms a step); {total} decode "
        f"samples; weights per step {weights / 1e6:.1f} MB (nominal {PRECISION_BITS[args.precision]} bits); XNNPACK's "
        f"kernels {gemm_ms:.2f} ms a step = {weights / gemm_ms / 1e6:.1f} GB/s "
        f"({100 * weights / gemm_ms / 1e3 / bandwidth * 1e6:.0f} % of matvec)"
    )
    print()
    print("| family | % of the decode step | ms a step |")
    print("|---|---|---|")
    for name, samples in by_family.most_common():
        print(f"| {name} | {100 * samples / total:.1f} | {step_ms * samples / total:.2f} |")
    print()
    print(f"| family | % of the prefill ({args.prompt} tokens) | ms of TTFT |")
    print("|---|---|---|")
    for name, samples in prefill_families.most_common():
        print(f"| {name} | {100 * samples / prefill_total:.1f} | {ttft * 1e3 * samples / prefill_total:.1f} |")
    print()
    print("| symbol | library | % of the decode step |")
    print("|---|---|---|")
    top = decode.most_common(20)
    for (dso, sym), samples in top:
        print(f"| `{sym[:90]}` | {dso} | {100 * samples / total:.1f} |")
    if args.json:
        record = {
            "precision": args.precision,
            "layers": args.layers,
            "prompt": args.prompt,
            "new": args.new,
            "cache": args.cache,
            "load": [load_start, load_end],
            "bandwidth_bytes_per_s": bandwidth,
            "export_s": export_s,
            "stage_seconds": stages,
            "export_profile": slow,
            "ttft_s": ttft,
            "tokens_per_s": tokens_per_s,
            "decode_samples": total,
            "families": dict(by_family),
            "prefill_families": dict(prefill_families),
            "top_symbols": [[dso, sym, n] for (dso, sym), n in top],
        }
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
