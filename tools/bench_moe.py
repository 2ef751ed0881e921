"""MoE prefill at a realistic width: peak memory and time of each experts form on each backend.

    python tools/bench_moe.py [--tokens 16] [--experts 32] [--hidden 2048] [--inter 768] [--top-k 8]
                              [--cases eager:default,dynamo:routed,...] [--as-limit 6000000000]

A 1-layer `Qwen3MoeModel` (fp32, seed 0, vocab 1024, attention 16 heads x 128, Qwen3-30B-A3B's MoE width by default:
hidden 2048, expert intermediate 768, top-8; fewer experts than its 128 to keep the weights small) runs one prefill
of `--tokens` tokens. Forms: `default` (transformers' `grouped_mm` experts, what the model runs unpatched),
`batched` (transformers' `batched_mm`: gathers every (token, slot) pair's expert weights), `routed` (hfexport's
`routed_experts_forward`: per expert over its pairs). On OpenVINO and ExecuTorch the `routed` form is what
hfexport's rules trace; `batched` there is the model set to `batched_mm` (the rules decline it). On eager, Dynamo and
ONNX `routed` is registered as a transformers experts implementation by this tool (measurement only).

Each case runs in its own child process (`nice`, RLIMIT_AS capped): export, load, then the peak resident memory of
the first prefill above the resident size just before it (VmHWM reset through /proc/self/clear_refs), the median
time of `--repeat` more prefills, and the max abs difference of `last_hidden_state` against eager `default`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any

CASES = (
    "eager:default,eager:batched,eager:routed,dynamo:default,dynamo:batched,dynamo:routed,onnx:batched,onnx:routed,"
    "openvino:batched,openvino:routed,executorch:batched,executorch:routed"
)
ROUTED = "hfexport_routed"


def _model(args: argparse.Namespace, form: str) -> Any:
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeModel
    from transformers.integrations import moe

    from hfexport.rewrites.experts import routed_experts_forward

    moe.ALL_EXPERTS_FUNCTIONS.register(ROUTED, routed_experts_forward)
    config = Qwen3MoeConfig(
        vocab_size=1024,
        hidden_size=args.hidden,
        intermediate_size=args.inter,
        moe_intermediate_size=args.inter,
        num_hidden_layers=1,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
    )
    torch.manual_seed(0)
    model = Qwen3MoeModel(config).eval()
    implementation = {"default": None, "batched": "batched_mm", "routed": ROUTED}[form]
    if implementation is not None:
        model.set_experts_implementation(implementation)
    ids = torch.randint(0, 1024, (1, args.tokens), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "use_cache": False}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _hwm() -> int:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _runner(backend: str, model: Any, inputs: dict[str, Any], tmp: str, run: Any) -> Any:
    import torch

    if backend == "eager":
        return lambda: model(**inputs).last_hidden_state
    if backend == "dynamo":
        from hfexport import DynamoConfig, DynamoExporter

        module = DynamoExporter().export(model, inputs, DynamoConfig()).module()
        return lambda: module(**inputs).last_hidden_state
    if backend == "onnx":
        import onnxruntime as ort

        from hfexport import OnnxConfig, OnnxExporter
        from hfexport.naming import onnx_feed

        path = os.path.join(tmp, "model.onnx")
        OnnxExporter().export(model, inputs, OnnxConfig(output_path=path))
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]
        return lambda: torch.from_numpy(session.run(None, onnx_feed(names, inputs))[0])
    if backend == "openvino":
        from hfexport import OpenVINOConfig, OpenVINOExporter
        from hfexport.runtime.openvino import OpenVINORunner

        runner = OpenVINORunner(OpenVINOExporter().export(model, inputs, OpenVINOConfig()))
        return lambda: next(iter(runner(**inputs).values()))
    if backend == "executorch":
        from hfexport import ExecutorchConfig, ExecutorchExporter
        from hfexport.runtime.executorch import ExecutorchProgram

        manager = ExecutorchExporter().export(model, inputs, ExecutorchConfig())
        # The planned buffers are allocated when the program loads, before the measured run: report their size.
        run.planned_mb = sum(manager.executorch_program.execution_plan[0].non_const_buffer_sizes) / 2**20
        program = ExecutorchProgram(manager)
        return lambda: program.run(inputs)[0]
    raise ValueError(backend)


def child(backend: str, form: str, args: argparse.Namespace) -> None:
    import gc

    import torch

    torch.set_num_threads(args.threads)
    model, inputs = _model(args, form)
    with torch.no_grad():
        reference_model, _ = _model(args, "default")
        expected = reference_model(**inputs).last_hidden_state
        del reference_model
        start = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            planned = argparse.Namespace(planned_mb=None)
            run = _runner(backend, model, inputs, tmp, planned)
            export_s = time.perf_counter() - start
            if backend != "eager":
                del model
            gc.collect()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current resident size
            before = _rss()
            start = time.perf_counter()
            actual = run()
            first_s = time.perf_counter() - start
            peak = _hwm() - before
            times = []
            for _ in range(args.repeat):
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
    times.sort()
    row = {
        "backend": backend,
        "form": form,
        "tokens": args.tokens,
        "peak_mb": peak / 2**20,
        "first_s": first_s,
        "median_s": times[len(times) // 2] if times else first_s,
        "export_s": export_s,
        "max_diff": (actual.float() - expected.float()).abs().max().item(),
        "planned_mb": planned.planned_mb,
    }
    print("ROW " + json.dumps(row), flush=True)


def extrapolated_gb(tokens: int, top_k: int, hidden: int, inter: int, bytes_per: int) -> dict[str, float]:
    """Bytes of batched_mm's weight gathers per projection: one expert weight per (token, slot) pair."""
    pairs = tokens * top_k
    return {
        "gate_up": pairs * 2 * inter * hidden * bytes_per / 1e9,
        "down": pairs * hidden * inter * bytes_per / 1e9,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--experts", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--cases", default=CASES)
    parser.add_argument("--as-limit", type=int, default=6_000_000_000, help="RLIMIT_AS of each child, bytes")
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--child", nargs=2, metavar=("BACKEND", "FORM"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], args.child[1], args)
        return 0

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (args.as_limit, args.as_limit))
        os.nice(5)

    passed = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("tokens", "experts", "hidden", "inter", "top_k")]
    passed += [f"--repeat={args.repeat}", f"--threads={args.threads}"]
    rows = []
    for case in args.cases.split(","):
        backend, form = case.split(":")
        cmd = [sys.executable, __file__, *passed, "--child", backend, form]
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=args.timeout, preexec_fn=limit, env=os.environ
            )
            found = [line[4:] for line in done.stdout.splitlines() if line.startswith("ROW ")]
            if found:
                row = json.loads(found[-1])
            else:
                tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
                row = {"backend": backend, "form": form, "error": f"rc {done.returncode}: " + " | ".join(tail)}
        except subprocess.TimeoutExpired:
            row = {"backend": backend, "form": form, "error": f"timeout {args.timeout} s"}
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
        if args.json:  # after every case: a later one may run out of time
            with open(args.json, "w") as f:
                json.dump({"args": {k: v for k, v in vars(args).items() if k != "child"}, "rows": rows}, f, indent=1)

    ok = [r for r in rows if "peak_mb" in r]
    eager = next((r for r in ok if (r["backend"], r["form"]) == ("eager", "default")), None)
    print(f"load average: {os.getloadavg()}")
    print(
        f"| backend | form | peak MB over baseline (ExecuTorch: + planned) | x eager | median s | x eager | max diff | "
        f"(tokens {args.tokens}, experts {args.experts}, hidden {args.hidden}, inter {args.inter}, top-{args.top_k})"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['backend']} | {r['form']} | error: {r['error'][:160]} | | | | |")
            continue
        peak = r["peak_mb"] + (r.get("planned_mb") or 0)
        peak_x = peak / eager["peak_mb"] if eager and eager["peak_mb"] > 0 else float("nan")
        time_x = r["median_s"] / eager["median_s"] if eager else float("nan")
        print(
            f"| {r['backend']} | {r['form']} | {peak:.0f} | {peak_x:.2f} | {r['median_s']:.3f} | "
            f"{time_x:.2f} | {r['max_diff']:.2e} |"
        )
    gb = extrapolated_gb(args.tokens, args.top_k, args.hidden, args.inter, 4)
    print(f"batched_mm weight gathers, this run (fp32): gate_up {gb['gate_up']:.2f} GB, down {gb['down']:.2f} GB")
    gb = extrapolated_gb(512, 8, 2048, 768, 2)
    print(
        "batched_mm weight gathers, Qwen3-30B-A3B 512-token prefill (bf16, hidden 2048, inter 768, top-8): "
        f"gate_up {gb['gate_up']:.1f} GB, down {gb['down']:.1f} GB per layer"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
