"""Side by side: hfexport's generation exports against the tools users deploy with (issue #41, item 1).

    tools/peers/setup.sh [--dir DIR]                   # once: each peer in a virtual environment of its own
    python tools/bench_peers.py [--shapes smollm2-135m,qwen2.5-0.5b] [--layers N] [--rows ROW,...] [--rounds 2]
        [--prompt 128] [--new 64] [--peers DIR] [--work DIR] [--json FILE]

Rows (`--rows` takes these names, or a family such as `optimum-intel`): eager `generate` (the reference),
hfexport's `export_for_generation` on ONNX Runtime, OpenVINO (stateful) and ExecuTorch at fp32 and int4 (the
recipes of `hfexport.apps.bench.quantizer_for`), and each backend's peer with its own build and generation loop:
onnxruntime-genai 0.18 (`onnxruntime_genai.models.builder -p fp32|int4 -e cpu`, `Generator`), optimum-intel 2.2
(`OVModelForCausalLM`, stateful; f32 inference hint like ours, int4 with our OpenVINO recipe: symmetric, groups of
32, every layer; also its default hint, bf16 where the CPU has it) and optimum-executorch 1.1 (XNNPACK, custom SDPA
and KV cache; fp32 and 8da4w). The model is a random Llama/Qwen2 of the shape (seed 0), saved as a folder every row
reads. Each build runs in its own process (wall seconds, peak RSS of that process from `wait4`, bytes of the folder
it writes), each row's generation in its own process per round (batch 1, greedy, `--new` tokens after a random
`--prompt`; rows alternate within a round, so a change of load lands on all of them), and the matvec bandwidth is
measured every round. Timings are medians over rounds. `--layers 2` gives a quick check of every row; its figures
are not timing-grade, and neither are any taken on a busy machine (the load is recorded).

Tokens: `k/N` is how many of the N generated tokens equal eager's position by position, and `first m` how many
agree before the first difference. On random weights the logits are nearly flat (SmolLM2's shape: eager's top five
within 0.24 of each other), so quantized rows part from eager early, and a position-by-position count can be high by
coincidence (a row that repeats eager's runner-up token matches eager wherever eager repeats it too).

The peers are never imported by hfexport or by this script: their steps run `tools/peers/row.py` under the
peer's interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hfexport.apps.bench import cpu_description
from hfexport.apps.bench_peers import RowResult, RowSpec, parse_args, table

ROOT = Path(__file__).resolve().parents[1]
ROW_SCRIPT = ROOT / "tools" / "peers" / "row.py"


# -- processes ---------------------------------------------------------------------------------------------------


@dataclass
class Child:
    """A finished step: its result line, wall seconds, peak RSS (MB, the process and the children it waited for)."""

    result: dict[str, Any] | None
    seconds: float
    peak_rss_mb: float
    error: str = ""


def python_of(row: RowSpec, peers: Path) -> str:
    return sys.executable if row.env is None else str(peers / row.env / "bin" / "python")


def environment(row: RowSpec | None) -> dict[str, str]:
    """This process's environment; hfexport's rows get the checkout on PYTHONPATH, the peers' rows none of it."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if row is None or row.env is None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return env


def run_child(python: str, args: list[str], env: dict[str, str], timeout: float, log: Path) -> Child:
    """Run `row.py args` under `python`, its output to `log`; wall time and peak RSS from `wait4`."""
    start = time.perf_counter()
    with open(log, "w") as out:
        process = subprocess.Popen([python, str(ROW_SCRIPT), *args], stdout=out, stderr=subprocess.STDOUT, env=env)
        deadline = start + timeout
        while True:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                process.kill()
                pid, status, usage = os.wait4(process.pid, 0)
                break
            time.sleep(0.05)
        process.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - start
    text = log.read_text(errors="replace")
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    error = ""
    if process.returncode or not lines:
        tail = [line for line in text.splitlines() if line.strip()][-1:] or [f"exit {process.returncode}"]
        error = f"exit {process.returncode}: {tail[0][:200]}"
    value = json.loads(lines[-1][len("RESULT ") :]) if lines else None
    return Child(value, seconds, usage.ru_maxrss / 1024, error)


def disk_bytes(folder: Path) -> int:
    return sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())


def peer_versions(peers: Path, rows: list[RowSpec]) -> dict[str, list[str]]:
    """The pins of each peer environment the rows use (its freeze.txt, written by tools/peers/setup.sh)."""
    versions = {}
    for env in sorted({row.env for row in rows if row.env}):
        freeze = peers / env / "freeze.txt"
        if freeze.exists():
            names = ("torch", "transformers", "onnxruntime", "openvino", "nncf", "executorch", "optimum", "torchao")
            lines = freeze.read_text().splitlines()
            versions[env] = [line for line in lines if line.split("==")[0].lower().startswith(names)]
    return versions


def bench_shape(shape: str, args: argparse.Namespace, work: Path) -> dict[str, Any]:
    rows: list[RowSpec] = args.rows
    folder = work / f"{shape}-{args.layers or 'full'}"
    folder.mkdir(parents=True, exist_ok=True)
    logs = folder / "logs"
    logs.mkdir(exist_ok=True)
    model = folder / "model"
    say = lambda message: print(f"[{shape}] {message}", flush=True)  # noqa: E731
    layer_args = ["--layers", str(args.layers)] if args.layers else []
    made = run_child(
        sys.executable,
        ["model", "--shape", shape, *layer_args, "--out", str(model)],
        environment(None),
        args.timeout,
        logs / "model.log",
    )
    if made.result is None:
        raise SystemExit(f"[{shape}] building the model folder failed: {made.error} (log {logs / 'model.log'})")
    config = json.loads((model / "config.json").read_text())
    millions = made.result["parameters"] / 1e6
    say(f"model folder {model}: {config['num_hidden_layers']} layers, {millions:.1f} M parameters")
    prompt = [random.Random(1).randrange(3, config["vocab_size"]) for _ in range(args.prompt)]
    (folder / "prompt.json").write_text(json.dumps(prompt))
    max_length = args.prompt + args.new
    results = {row.key: RowResult(row.key, row.precision) for row in rows}
    artifacts = {row.artifact_key: folder / row.artifact_key.replace(":", "-") for row in rows}

    for row in rows:
        if not row.builds:
            continue
        out = artifacts[row.key]
        result = results[row.key]
        if args.reuse and (out / ".built.json").exists():
            built = json.loads((out / ".built.json").read_text())
            result.export_s, result.peak_rss_mb = built["export_s"], built["peak_rss_mb"]
        else:
            say(f"{row.key}: build")
            child = run_child(
                python_of(row, args.peers),
                [
                    *("build", "--row", row.name, "--precision", row.precision, "--model", str(model)),
                    *("--out", str(out), "--max-length", str(max_length)),
                ],
                environment(row),
                args.timeout,
                logs / f"build-{row.key.replace(':', '-')}.log",
            )
            if child.error:
                result.note = f"build: {child.error}"
                say(f"{row.key}: build failed: {child.error}")
                continue
            result.export_s, result.peak_rss_mb = child.seconds, child.peak_rss_mb
            (out / ".built.json").write_text(json.dumps({"export_s": child.seconds, "peak_rss_mb": child.peak_rss_mb}))
        result.disk_bytes = disk_bytes(out) - (out / ".built.json").stat().st_size
        megabytes = result.disk_bytes / 1e6
        say(f"{row.key}: built in {result.export_s:.0f} s, peak {result.peak_rss_mb:.0f} MB, {megabytes:.0f} MB")
    for row in rows:  # a row that runs another row's artifact reports that build
        if row.build_precision and row.artifact_key in results:
            source = results[row.artifact_key]
            results[row.key].note = results[row.key].note or f"the {row.artifact_key} artifact"
            results[row.key].disk_bytes = source.disk_bytes

    bandwidths = []
    load = [os.getloadavg()[0]]
    matrix = ["ceiling", "--megabytes", str(512 if not args.layers or args.layers > 4 else 64)]
    for round_ in range(args.rounds):
        measured = run_child(sys.executable, matrix, environment(None), 600, logs / "ceiling.log")
        if measured.result:
            bandwidths.append(measured.result["bandwidth"])
        for row in rows:
            result = results[row.key]
            if results[row.artifact_key].note.startswith("build:"):
                continue
            child = run_child(
                python_of(row, args.peers),
                [
                    *("run", "--row", row.name, "--precision", row.precision, "--model", str(model)),
                    *("--out", str(artifacts[row.artifact_key]), "--prompt", str(folder / "prompt.json")),
                    *("--new", str(args.new)),
                ],
                environment(row),
                args.timeout,
                logs / f"run-{row.key.replace(':', '-')}-{round_}.log",
            )
            if child.error or child.result is None:
                result.note = f"run: {child.error}"
                say(f"{row.key}: round {round_} failed: {child.error}")
                continue
            reading = child.result
            result.ttft_s.append(reading["ttft_s"])
            result.decode_tokens_per_s.append((args.new - 1) / reading["decode_s"])
            result.tokens = reading["tokens"]
            rate = result.decode_tokens_per_s[-1]
            say(f"{row.key}: round {round_}: TTFT {reading['ttft_s'] * 1e3:.0f} ms, {rate:.1f} tok/s")
    load.append(os.getloadavg()[0])
    ordered = [results[row.key] for row in rows]
    bandwidth = statistics.median(bandwidths) if bandwidths else float("nan")
    ceiling = bandwidth / made.result["weight_bytes_per_token"]
    print()
    print(
        f"{shape}, {config['num_hidden_layers']} layers: load {load[0]:.1f} -> {load[1]:.1f}; matvec "
        f"{min(bandwidths, default=float('nan')) / 1e9:.1f}-{max(bandwidths, default=float('nan')) / 1e9:.1f} GB/s; "
        f"weights per token {made.result['weight_bytes_per_token'] / 1e6:.1f} MB; fp32 ceiling {ceiling:.1f} tok/s; "
        f"prompt {args.prompt}, {args.new} new tokens, {args.rounds} round(s)"
    )
    print(table(ordered, ceiling, args.new))
    print()
    return {
        "shape": shape,
        "config": config,
        "layers": config["num_hidden_layers"],
        "load": load,
        "bandwidths": bandwidths,
        "weight_bytes_per_token": made.result["weight_bytes_per_token"],
        "ceiling_tokens_per_s": ceiling,
        "rows": [asdict(r) for r in ordered],
        "table": table(ordered, ceiling, args.new),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv, __doc__.splitlines()[0])
    missing = sorted({row.env for row in args.rows if row.env and not Path(python_of(row, args.peers)).exists()})
    if missing:
        setup = f"tools/peers/setup.sh --dir {args.peers}"
        raise SystemExit(f"no environment for {', '.join(missing)} under {args.peers}: run {setup}")
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as scratch:
        work = args.work or Path(scratch)
        record = {
            "cpu": cpu_description(),
            "prompt": args.prompt,
            "new": args.new,
            "rounds": args.rounds,
            "peers": peer_versions(args.peers, args.rows),
            "shapes": [bench_shape(shape, args, work) for shape in args.shapes],
        }
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
