"""Where a generation step's time goes: per-op-type profiles of the prefill call and of the mean decode step.

    python tools/profile_generate.py --backend {onnx,openvino,openvino-stateful,dynamo} \\
        --precision {fp32,int8,int4} [--layers 30] [--prompt 128] [--new 16] [--cache 256] [--threads N]
        [--json FILE] [--trace-dir DIR]

The model and export are `tools/bench_generate.py`'s (`hfexport.apps.bench.bench_generation`): the SmolLM2-135M-shaped
Llama of `tools/bench_onnx.build_model` (random weights, seed 0), `export_for_generation` with a static cache of
`--cache` slots (256: the benchmark's 128 + 128) and one multi-token decode graph, each backend's recipe from
`hfexport.apps.bench.quantizer_for`, run by `hfexport.runtime.generate` on one random prompt (batch 1). After a warm-up
generation, the prompt alone is profiled (4 calls) and then one generation of `--new` tokens, whose calls after the
first are the decode steps. ONNX Runtime traces single calls: per node, the median over the calls. OpenVINO's
counters are means over all calls so far: the mean call of a window (the 4 prompts; the decode steps after the
first). Dynamo: the mean.

Profiles come from the runtimes' own options, handed over by `generate(..., runtime_options=RuntimeOptions(...))`:
ONNX Runtime's `SessionOptions.enable_profiling` (kernel time per node, from its JSON trace), OpenVINO's
`PERF_COUNT` (`InferRequest.get_profiling_info()`: real time per executed node, a mean over the calls so far;
OpenVINO runs also time `InferRequest.infer` alone on a decode step's feed), and for Dynamo `torch.profiler`
around the ExportedProgram's module (self CPU time per aten op; the decode step is the profile of the whole
generation less the profile of a 1-token generation, over `new - 1`). Dynamo runs also profile eager
`model.generate`'s prefill (which computes the head on the last position only). On a shared machine give Dynamo
`--threads 1`: with 2 threads and another busy process, each parallel aten op waits at its OpenMP barrier.
See docs/benchmarks.md ("Where a decode step's time goes") and docs/benchmarks/history/ for the results.

"head": the nodes whose output has the vocabulary as its last axis (the output projection and what scales or
casts its result): in the prefill, the cost of the logits of every prompt position, which the exported graphs
return (the seeds' contract) where eager's `generate` computes the last one. The tool also times the head alone
in torch (`F.linear` over `prompt` rows vs 1 row), a bound for backends that are not profiled (ExecuTorch).

Weight ops (MatMul / Gemm / MatMulInteger / MatMulNBits / FullyConnected...): their bytes of constant inputs
per decode step over their time, against this machine's matrix-vector bandwidth
(`hfexport.apps.bench.matvec_bandwidth`, measured in the same run).
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_onnx import build_model  # tools/ is on sys.path when this script runs

from hfexport.apps.bench import matvec_bandwidth, quantizer_for, weight_bytes_per_token

BACKENDS = ("onnx", "openvino", "openvino-stateful", "dynamo")
# Prefill calls profiled (ONNX Runtime, OpenVINO): per node, the median over them.
PREFILLS = 4
# Op types that stream a weight matrix (ONNX Runtime, OpenVINO CPU plugin node types, aten).
WEIGHT_OPS = {
    "MatMul",
    "Gemm",
    "FusedMatMul",
    "MatMulInteger",
    "MatMulNBits",
    "DynamicQuantizeMatMul",
    "MatMulIntegerToFloat",
    "FullyConnected",
    "FullyConnectedCompressed",
    "aten::mm",
    "aten::addmm",
    "aten::bmm",
}


@dataclasses.dataclass
class CallProfile:
    """One call (or the mean of several): microseconds per op type, the head's share, the call's wall time."""

    ops: dict[str, float]  # op type -> microseconds
    head_us: float = 0.0
    wall_us: float = float("nan")
    weight_bytes: dict[str, float] = dataclasses.field(default_factory=dict)  # weight op type -> bytes read
    # The slowest nodes: [name, op type, microseconds, output shapes or ""].
    top_nodes: list[list[Any]] = dataclasses.field(default_factory=list)
    # OpenVINO: median microseconds of `InferRequest.infer` alone on a decode step's feed.
    infer_us: float = float("nan")
    # Per executed node: name -> [op type, microseconds, weight bytes, is a head node] (not written to JSON).
    nodes: dict[str, list[Any]] = dataclasses.field(default_factory=dict, repr=False)

    def record(self) -> dict[str, Any]:
        """The profile for the JSON file (without the per-node table)."""
        return {k: v for k, v in dataclasses.asdict(self).items() if k != "nodes"}

    @property
    def total_us(self) -> float:
        return sum(self.ops.values())


def mean_profile(calls: list[CallProfile]) -> CallProfile:
    ops: dict[str, float] = collections.defaultdict(float)
    weights: dict[str, float] = collections.defaultdict(float)
    for call in calls:
        for k, v in call.ops.items():
            ops[k] += v / len(calls)
        for k, v in call.weight_bytes.items():
            weights[k] += v / len(calls)
    head = sum(c.head_us for c in calls) / len(calls)
    walls = [c.wall_us for c in calls if c.wall_us == c.wall_us]  # NaN: a call whose wall time is not its own
    wall = sum(walls) / len(walls) if walls else float("nan")
    return CallProfile(dict(ops), head, wall, dict(weights), calls[-1].top_nodes, infer_us=calls[-1].infer_us)


def median_profile(calls: list[CallProfile]) -> CallProfile:
    """Per node, the median of its time over `calls`; summed per op type. On this shared 2-core machine a step
    now and then waits for a core inside one node (a single MatMul of a few KB at 4 ms); a median per node
    drops those stalls where a mean spreads them over the op types they happened to hit."""
    import statistics

    times: dict[str, list[float]] = collections.defaultdict(list)
    last: dict[str, list[Any]] = {}
    for call in calls:
        for name, (op, us, weight, head) in call.nodes.items():
            times[name].append(us)
            last[name] = [op, us, weight, head]
    ops: dict[str, float] = collections.defaultdict(float)
    weights: dict[str, float] = collections.defaultdict(float)
    head_us = 0.0
    top = []
    for name, values in times.items():
        op, _, weight, head = last[name]
        # A node that did not run in every call counts as zero in those it skipped.
        us = statistics.median(values + [0.0] * (len(calls) - len(values)))
        ops[op] += us
        if weight:
            weights[op] += weight
        if head:
            head_us += us
        top.append([name, op, us, ""])
    walls = [c.wall_us for c in calls if c.wall_us == c.wall_us]
    wall = statistics.median(walls) if walls else float("nan")
    return CallProfile(dict(ops), head_us, wall, dict(weights), _top(top))


def _top(nodes: list[list[Any]], n: int = 12) -> list[list[Any]]:
    return sorted(nodes, key=lambda x: -x[2])[:n]


# --- ONNX Runtime ------------------------------------------------------------------------------------------


def _constant_bytes(path: str) -> dict[str, int]:
    """Node name -> bytes of its initializer inputs, in the optimized model ONNX Runtime wrote (the trace names
    its nodes; the trace's own shapes leave out initializers)."""
    import numpy as np
    import onnx
    from onnx.helper import tensor_dtype_to_np_dtype

    model = onnx.load(path, load_external_data=False)
    sizes = {
        i.name: int(np.prod(i.dims, dtype=np.int64)) * np.dtype(tensor_dtype_to_np_dtype(i.data_type)).itemsize
        for i in model.graph.initializer
    }
    return {n.name: sum(sizes.get(i, 0) for i in n.input) for n in model.graph.node}


def profile_onnx(components: Any, ids: Any, new: int, vocab: int, prefix: str) -> tuple[CallProfile, list[CallProfile]]:
    import onnxruntime as ort

    from hfexport.runtime.drivers import RuntimeOptions
    from hfexport.runtime.generation import generate
    from hfexport.runtime.generation_session import generation_driver

    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = prefix
    # Every session of the components writes here; the decode session is made last and its model stays.
    options.optimized_model_filepath = prefix + "_optimized.onnx"
    runtime = RuntimeOptions(onnx_session_options=options)
    generate(components, ids, max_new_tokens=2, min_new_tokens=2, runtime_options=runtime)  # warm-up: 2 calls
    for _ in range(PREFILLS - 1):
        generate(components, ids, max_new_tokens=1)  # the prompt alone
    generate(components, ids, max_new_tokens=new, min_new_tokens=new)  # its first call is a prefill too
    session = generation_driver(components).sessions["decode"]
    events = json.loads(Path(session.end_profiling()).read_text())
    constants = _constant_bytes(options.optimized_model_filepath)
    runs = sorted((e for e in events if e.get("name") == "model_run"), key=lambda e: e["ts"])[2:]
    events_by_time = sorted(
        (e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")), key=lambda e: e["ts"]
    )
    calls = []
    for run in runs:
        start, end = run["ts"], run["ts"] + run["dur"]
        ops: dict[str, float] = collections.defaultdict(float)
        weights: dict[str, float] = collections.defaultdict(float)
        head = 0.0
        seen = []
        nodes: dict[str, list[Any]] = {}
        for e in events_by_time:
            if not start <= e["ts"] <= end:
                continue
            args = e["args"]
            op = args["op_name"]
            ops[op] += e["dur"]
            name = e["name"].removesuffix("_kernel_time")
            seen.append([name, op, e["dur"], str(args.get("output_type_shape", ""))])
            weight = constants.get(name, 0) if op in WEIGHT_OPS else 0
            weights[op] += weight
            out = args.get("output_type_shape") or []
            is_head = any(dims and dims[-1] == vocab for entry in out for dims in entry.values())
            if is_head:
                head += e["dur"]
            previous = nodes.get(name)  # a node runs once per call; summed if it ever ran twice
            nodes[name] = [op, e["dur"] + (previous[1] if previous else 0), weight, is_head]
        weights = {k: v for k, v in weights.items() if v}
        calls.append(CallProfile(dict(ops), head, run["dur"], dict(weights), _top(seen), nodes=nodes))
    return median_profile(calls[:PREFILLS]), calls[PREFILLS:]


# --- OpenVINO ----------------------------------------------------------------------------------------------


def _openvino_layout(compiled: Any, vocab: int) -> tuple[set[str], dict[str, int]]:
    """(names of executed nodes whose output's last axis is the vocabulary, bytes of constant inputs per weight
    node) from the compiled model's runtime graph."""
    head: set[str] = set()
    weights: dict[str, int] = {}
    for op in compiled.get_runtime_model().get_ordered_ops():
        name = op.get_friendly_name()
        for i in range(op.get_output_size()):
            shape = op.get_output_partial_shape(i)
            if shape.rank.is_static and shape.rank.get_length() and shape[shape.rank.get_length() - 1] == vocab:
                head.add(name)
        total = 0
        for port in op.inputs():
            source = port.get_source_output().get_node()
            if source.get_rt_info()["layerType"].astype(str) == "Const":
                shape = source.get_output_partial_shape(0)
                if shape.is_static:
                    n = 1
                    for d in shape.to_shape():
                        n *= d
                    total += n * source.get_output_element_type(0).bitwidth // 8
        if total:
            weights[name] = total
    return head, weights


def _openvino_counters(request: Any) -> dict[str, tuple[str, str, float]]:
    """name -> (node type, exec type, real-time microseconds) of the executed nodes, as the request reports them.

    The CPU plugin's counter of a node is the mean over every call the compiled model has run (its `PerfCount`:
    `total_duration / num`, whole microseconds per execution, truncated): the calls between two readings, at
    `a` and `b` calls, took `(mean_b * b - mean_a * a) / (b - a)` per call (`_openvino_window`). The truncation
    of each execution to whole microseconds leaves out up to 1 us per node and call."""
    return {
        n.node_name: (n.node_type, n.exec_type, n.real_time.total_seconds() * 1e6)
        for n in request.get_profiling_info()
        if not str(n.status).endswith("NOT_RUN")
    }


def _openvino_window(
    before: dict[str, tuple[str, str, float]],
    calls_before: int,
    after: dict[str, tuple[str, str, float]],
    calls_after: int,
    head: set[str],
    weights: dict[str, int],
    wall_us: float,
) -> CallProfile:
    """The mean call between two readings of the counters (at `calls_before` and `calls_after` calls)."""
    ops: dict[str, float] = collections.defaultdict(float)
    bytes_: dict[str, float] = collections.defaultdict(float)
    head_us = 0.0
    seen = []
    for name, (node_type, exec_type, mean) in after.items():
        previous = before.get(name, (node_type, exec_type, 0.0))[2]
        us = max(0.0, mean * calls_after - previous * calls_before) / (calls_after - calls_before)
        ops[node_type] += us
        seen.append([name, f"{node_type} ({exec_type})", us, ""])
        if name in head:
            head_us += us
        weight = weights.get(name, 0) if node_type in WEIGHT_OPS else 0
        if weight:
            bytes_[node_type] += weight
    return CallProfile(dict(ops), head_us, wall_us, dict(bytes_), _top(seen))


def profile_openvino(components: Any, ids: Any, new: int, vocab: int) -> tuple[CallProfile, list[CallProfile]]:
    """(the mean of `PREFILLS` prompt calls, [the mean of the decode steps after the first]): OpenVINO's counters
    give means over windows of calls, not single calls (`_openvino_counters`)."""
    from hfexport.runtime.drivers import RuntimeOptions
    from hfexport.runtime.generation import generate
    from hfexport.runtime.generation_session import generation_driver

    runtime = RuntimeOptions(openvino_properties={"PERF_COUNT": "YES"})
    # Warm-up: 2 calls (the prompt, one decode step).
    generate(components, ids, max_new_tokens=2, min_new_tokens=2, runtime_options=runtime)
    driver = generation_driver(components)
    request = driver.requests["decode"]
    head, weights = _openvino_layout(driver.runners["decode"].compiled, vocab)
    before = _openvino_counters(request)
    start = time.perf_counter()
    for _ in range(PREFILLS):
        generate(components, ids, max_new_tokens=1)  # the prompt alone: one call
    wall = (time.perf_counter() - start) * 1e6 / PREFILLS
    after = _openvino_counters(request)
    prefill = _openvino_window(before, 2, after, 2 + PREFILLS, head, weights, wall)
    calls = 2 + PREFILLS
    state: dict[str, Any] = {}

    def step(_: Any) -> None:
        # The first reading comes after the prompt and the first step: the window starts there.
        state.setdefault("reading", _openvino_counters(request))
        state.setdefault("time", time.perf_counter())

    generate(components, ids, max_new_tokens=new, min_new_tokens=new, on_step=step)
    end_time, end = time.perf_counter(), _openvino_counters(request)
    # generate returns after the last step's token: new calls in all, the window holds the last new - 2 steps.
    wall = (end_time - state["time"]) * 1e6 / (new - 2)
    decode = _openvino_window(state["reading"], calls + 2, end, calls + new, head, weights, wall)
    decode.infer_us = _openvino_infer_only(driver, ids.shape[1] + new)
    return prefill, [decode]


def _openvino_infer_only(driver: Any, position: int, repeats: int = 10) -> float:
    """Median microseconds of `InferRequest.infer` alone on one decode step's feed (the generation loop's own
    Python work left out): what OpenVINO spends per call, nodes and everything around them."""
    import statistics

    import torch

    from hfexport.runtime.drivers import Step

    names = [port.get_any_name() for port in driver.runners["decode"].compiled.inputs]
    from hfexport.runtime.generation import static_mask

    caches = [t for t in driver.cache.values() if t.ndim == 4]
    # Stateful: the cache is in the request, its variables give the slots.
    states = driver.states.get("decode", {})
    slots = caches[0].shape[2] if caches else list(next(iter(states.values())).state.shape)[2]
    valid = torch.zeros(1, slots, dtype=torch.long)
    valid[:, : position + 1] = 1
    step = Step(torch.tensor([[5]]), static_mask(valid, position, 1), torch.tensor([[position]]))
    feed = {k: v.numpy() for k, v in driver.flat_feed("decode", step, names).items()}
    request = driver.requests["decode"]
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        request.infer(feed)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


# --- Dynamo (torch.profiler) -------------------------------------------------------------------------------


def _torch_profile(fn: Any, vocab: int) -> CallProfile:
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        fn()
        wall = (time.perf_counter() - start) * 1e6
    ops: dict[str, float] = collections.defaultdict(float)
    weights: dict[str, float] = collections.defaultdict(float)
    head = 0.0
    for e in prof.events():
        us = e.self_cpu_time_total
        if not us:
            continue
        ops[e.name] += us
        shapes = [s for s in (e.input_shapes or []) if isinstance(s, list)]
        if any(vocab in s for s in shapes):
            head += us
        if e.name in WEIGHT_OPS:
            # The weight is the 2-D operand with the most elements (fp32).
            mats = [s for s in shapes if len(s) == 2]
            if mats:
                weights[e.name] += max(a * b for a, b in mats) * 4
    del torch
    grouped = prof.key_averages(group_by_input_shape=True)
    top = [[a.key, a.key, a.self_cpu_time_total, str(a.input_shapes)] for a in grouped if a.self_cpu_time_total]
    return CallProfile(dict(ops), head, wall, dict(weights), _top(top))


def _subtract(full: CallProfile, first: CallProfile, steps: int) -> CallProfile:
    keys = set(full.ops) | set(first.ops)
    ops = {k: max(0.0, (full.ops.get(k, 0) - first.ops.get(k, 0)) / steps) for k in keys}
    weights = {k: (full.weight_bytes.get(k, 0) - first.weight_bytes.get(k, 0)) / steps for k in full.weight_bytes}
    return CallProfile(ops, (full.head_us - first.head_us) / steps, (full.wall_us - first.wall_us) / steps, weights)


def profile_dynamo(components: Any, ids: Any, new: int, vocab: int) -> tuple[CallProfile, list[CallProfile]]:
    from hfexport.runtime.generation import generate

    generate(components, ids, max_new_tokens=2, min_new_tokens=2)  # warm-up
    prefill = _torch_profile(lambda: generate(components, ids, max_new_tokens=1), vocab)
    full = _torch_profile(lambda: generate(components, ids, max_new_tokens=new, min_new_tokens=new), vocab)
    return prefill, [_subtract(full, prefill, new - 1)]


def profile_eager_prefill(model: Any, ids: Any, vocab: int) -> CallProfile:
    import torch

    def run() -> None:
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False)

    run()
    return _torch_profile(run, vocab)


def head_microbench(model: Any, prompt: int, repeats: int = 20) -> dict[str, float]:
    """The output projection alone in torch (`F.linear` with the model's head weight): ms over `prompt` rows and
    over 1 row, medians of `repeats`."""
    import statistics

    import torch

    weight = model.get_output_embeddings().weight.detach()
    result = {}
    for rows in (prompt, 1):
        x = torch.randn(1, rows, weight.shape[1])
        with torch.no_grad():
            torch.nn.functional.linear(x, weight)
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                torch.nn.functional.linear(x, weight)
                times.append(time.perf_counter() - start)
        result[f"torch_head_ms_{rows}_rows"] = statistics.median(times) * 1e3
    return result


# --- report ------------------------------------------------------------------------------------------------


def table(prefill: CallProfile, decode: CallProfile, bandwidth: float, top: int = 14) -> str:
    """Per op type: prefill ms and share, decode ms/step and share, and a weight op's GB/s in the decode step."""
    keys = sorted(set(prefill.ops) | set(decode.ops), key=lambda k: -(decode.ops.get(k, 0) + prefill.ops.get(k, 0)))
    lines = [
        "| op type | prefill ms | prefill % | decode ms/step | decode % | decode weight MB/step | GB/s | % of matvec |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def row(name: str, p: float, d: float, b: float | None) -> str:
        pp = 100 * p / prefill.total_us if prefill.total_us else float("nan")
        dp = 100 * d / decode.total_us if decode.total_us else float("nan")
        cells = [name, f"{p / 1e3:.2f}", f"{pp:.1f}", f"{d / 1e3:.3f}", f"{dp:.1f}"]
        if b:
            rate = b / (d / 1e6) if d else float("nan")
            cells += [f"{b / 1e6:.1f}", f"{rate / 1e9:.1f}", f"{100 * rate / bandwidth:.0f}%"]
        else:
            cells += ["", "", ""]
        return "| " + " | ".join(cells) + " |"

    rest_p = rest_d = 0.0
    for i, k in enumerate(keys):
        p, d = prefill.ops.get(k, 0.0), decode.ops.get(k, 0.0)
        if i < top:
            lines.append(row(k, p, d, decode.weight_bytes.get(k)))
        else:
            rest_p, rest_d = rest_p + p, rest_d + d
    if rest_p or rest_d:
        lines.append(row(f"other ({len(keys) - top} types)", rest_p, rest_d, None))
    wb = sum(decode.weight_bytes.values())
    wt = sum(decode.ops.get(k, 0.0) for k in decode.weight_bytes)
    # The op types that read constant weights in the decode step (an attention FusedMatMul reads none).
    lines.append(row("**all weight ops**", sum(prefill.ops.get(k, 0.0) for k in decode.weight_bytes), wt, wb))
    lines.append(row("**total (profiled)**", prefill.total_us, decode.total_us, None))
    return "\n".join(lines)


def export_like_bench(
    backend: str, precision: str, layers: int, prompt: int, cache: int, disable: str = ""
) -> tuple[Any, Any, Any, Any, float, float]:
    """The benchmark's model, prompt and `export_for_generation` (static cache of `cache` slots, one multi-token
    decode graph, `quantizer_for`'s recipe), with `disable` (comma-separated rule ids) switched off. Returns the
    model, the prompt ids, the exporter (its `reports` hold each component's stage seconds), the components, the
    export's seconds, and this machine's matvec bandwidth (bytes/s, measured before the export)."""
    import torch
    from transformers import GenerationConfig

    from hfexport.apps.bench import VARIANTS
    from hfexport.auto import AutoExportConfig, AutoHfExporter

    model = build_model(layers)
    bandwidth = matvec_bandwidth(512, 10)
    print(f"load {os.getloadavg()}; matvec bandwidth {bandwidth / 1e9:.1f} GB/s", flush=True)
    ids = torch.randint(3, model.config.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(1))
    settings = dict(VARIANTS.get(backend, {"export_format": backend, "dynamic": True}))
    if disable:
        settings["rules"] = {"disable": [rule for rule in disable.split(",") if rule]}
    config = AutoExportConfig.from_dict(settings)
    quantizer = quantizer_for(backend, precision)
    if quantizer is not None:
        config = dataclasses.replace(config, quantizer=quantizer)
    sample = {"input_ids": ids[:, :8].repeat(2, 1), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    static = GenerationConfig(cache_implementation="static", max_cache_len=cache)
    exporter = AutoHfExporter.from_config(config)
    start = time.perf_counter()
    components = exporter.export_for_generation(
        model, sample, config, generation_config=static, multi_token_decode=True
    )
    return model, ids, exporter, components, time.perf_counter() - start, bandwidth


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=BACKENDS, required=True)
    parser.add_argument("--precision", choices=("fp32", "int8", "int4"), default="fp32")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=16)
    parser.add_argument("--cache", type=int, default=256, help="static cache slots (the benchmark's prompt + new)")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch threads (the eager and Dynamo runs; default: torch's); ONNX Runtime and OpenVINO keep theirs",
    )
    parser.add_argument("--disable", default="", help="rule ids (or prefixes) to switch off, comma-separated: an A/B")
    parser.add_argument("--json", help="write the profiles to this file")
    parser.add_argument("--trace-dir", help="keep ONNX Runtime's JSON trace in this folder (default: a temporary one)")
    args = parser.parse_args(argv)

    import torch

    if args.threads:
        # On this shared 2-core machine a second busy process makes each parallel aten op wait for a core at its
        # OpenMP barrier (a 196 KB cache copy took 8 ms): one thread shows the ops without those waits.
        torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    model, ids, _, components, export_s, bandwidth = export_like_bench(
        args.backend, args.precision, args.layers, args.prompt, args.cache, args.disable
    )
    vocab = model.config.vocab_size
    print(f"exported in {export_s:.0f} s; load {os.getloadavg()}", flush=True)

    eager = None
    with tempfile.TemporaryDirectory() as tmp:
        if args.trace_dir:
            tmp = args.trace_dir
            Path(tmp).mkdir(parents=True, exist_ok=True)
        if args.backend == "onnx":
            prefill, steps = profile_onnx(components, ids, args.new, vocab, str(Path(tmp) / "ort"))
        elif args.backend.startswith("openvino"):
            prefill, steps = profile_openvino(components, ids, args.new, vocab)
        else:
            prefill, steps = profile_dynamo(components, ids, args.new, vocab)
            eager = profile_eager_prefill(model, ids, vocab)
    mean = mean_profile(steps)
    # Per-node medians where the runtime gives single calls (ONNX Runtime); OpenVINO's step is already a mean over
    # its window, Dynamo's a difference of two profiles.
    decode = median_profile(steps) if all(step.nodes for step in steps) else mean
    head_torch = head_microbench(model, args.prompt)
    load_end = os.getloadavg()

    weights = weight_bytes_per_token(model)
    print()
    print(
        f"{args.backend} {args.precision}, {args.layers} layers, prompt {args.prompt}, {args.new} new tokens, cache "
        f"{args.cache}; load {load_start[0]:.2f} -> {load_end[0]:.2f}; torch threads {torch.get_num_threads()}; "
        f"matvec {bandwidth / 1e9:.1f} GB/s; fp32 "
        f"weights per token {weights / 1e6:.1f} MB"
    )
    print(
        f"prefill: profiled {prefill.total_us / 1e3:.1f} ms, wall {prefill.wall_us / 1e3:.1f} ms; head "
        f"{prefill.head_us / 1e3:.1f} ms = {100 * prefill.head_us / prefill.total_us:.1f} % of the profiled prefill"
    )
    print(
        f"decode step ({'median per node' if decode is not mean else 'mean'} of {len(steps)}): profiled "
        f"{decode.total_us / 1e3:.2f} ms, wall {decode.wall_us / 1e3:.2f} ms ({1e6 / decode.wall_us:.1f} tok/s); "
        f"head {decode.head_us / 1e3:.2f} ms; the mean step: profiled {mean.total_us / 1e3:.2f} ms, wall "
        f"{mean.wall_us / 1e3:.2f} ms"
    )
    if decode.infer_us == decode.infer_us:
        print(f"OpenVINO InferRequest.infer alone on a decode step's feed: {decode.infer_us / 1e3:.2f} ms")
    print(f"torch head alone: {head_torch}")
    print()
    print(table(prefill, decode, bandwidth))
    if eager is not None:
        print()
        print(
            f"eager model.generate prefill (1 token): profiled {eager.total_us / 1e3:.1f} ms, wall "
            f"{eager.wall_us / 1e3:.1f} ms, head {eager.head_us / 1e3:.1f} ms"
        )
        print(table(eager, CallProfile({}), bandwidth))
    if args.json:
        record = {
            "backend": args.backend,
            "precision": args.precision,
            "layers": args.layers,
            "prompt": args.prompt,
            "new": args.new,
            "cache": args.cache,
            "load": [load_start[0], load_end[0]],
            "torch_threads": torch.get_num_threads(),
            "bandwidth_bytes_per_s": bandwidth,
            "fp32_weight_bytes_per_token": weights,
            "export_s": export_s,
            "prefill": prefill.record(),
            "decode": decode.record(),
            "decode_is": "median per node over the steps" if decode is not mean else "mean",
            "decode_mean": mean.record(),
            "decode_steps": len(steps),
            "torch_head": head_torch,
            "eager_prefill": eager.record() if eager is not None else None,
        }
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
