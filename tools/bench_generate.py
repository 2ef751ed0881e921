"""Generation benchmark: decode tokens/s and time to first token, eager vs the peer vs hfexport per backend.

    python tools/bench_generate.py [--prompt 128] [--new 128] [--layers 30] [--backends onnx,executorch,...]
        [--precisions fp32,int8,int4] [--quick]

`--quick`: a 2-layer model, a 16-token prompt, 8 new tokens, one repeat (a smoke run of the whole table; its
timings mean nothing). One table row per backend x precision: TTFT, decode tok/s, % of that precision's
ceiling, x eager, tokens vs eager (fp32 eager), export seconds and the export's peak RSS over the process's
before it (polled every 20 ms). Quantized rows use each backend's weight-only (or dynamic) recipe of
`PRECISIONS`; their ceiling is the fp32 one times 32/bits (nominal: scales and the unquantized embedding
gather are not counted).

SmolLM2-135M-shaped Llama (random weights, seed 0), batch 1. Rows: eager `model.generate` (dynamic cache),
the peer (`transformers.exporters`, ONNX, driven by the same loop where it can run), and hfexport's
`export_for_generation` + `hfexport.runtime.generate` per backend (static cache of prompt + new slots, one
multi-token decode graph); `openvino-stateful` is OpenVINO with the cache kept in the infer request
(`OpenVINOConfig(stateful=True)`), beside `openvino`, which feeds it back every step. TTFT is a 1-token
generate; decode tok/s is (new - 1) / (time(new) - TTFT).
The same run measures this machine's matrix-vector bandwidth (fp32 `torch.mv` over a matrix far larger
than cache) and the decode ceiling it implies: bandwidth / weight bytes read per token.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from bench_onnx import _rss_bytes, build_model  # tools/ is on sys.path when this script runs

# Backend rows that are a config variant of a format rather than the format's defaults.
VARIANTS: dict[str, dict[str, Any]] = {
    "openvino-stateful": {"export_format": "openvino", "dynamic": True, "stateful": True},
}


# Weight bits of each precision (the ceiling scales with them) and its recipe per backend: (quantizer factory).
BITS = {"fp32": 32, "int8": 8, "int4": 4}


def _quantizer(backend: str, precision: str) -> Any:
    """The quantizer of `precision` on `backend`: int8 = dynamic activations / int8 weights where the backend has
    it, int4 = NNCF int4 weights (group 32); None for fp32. Raises for a pair with no recipe."""
    import hfexport as hx

    if precision == "fp32":
        return None
    fmt = VARIANTS.get(backend, {}).get("export_format", backend)
    int4 = hx.NNCFWeightCompressionConfig(mode="int4_sym", group_size=32)
    int8 = hx.NNCFWeightCompressionConfig(mode="int8_sym")
    if fmt == "onnx":
        return (
            hx.OnnxRuntimeQuantizer(hx.OnnxRuntimeDynamicConfig())
            if precision == "int8"
            else hx.NNCFOnnxQuantizer(int4)
        )
    if fmt == "openvino":
        return hx.NNCFOpenVINOQuantizer(int8 if precision == "int8" else int4)
    if fmt == "executorch" and precision == "int8":
        from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
            XNNPACKQuantizer,
            get_symmetric_quantization_config,
        )

        xnnpack = XNNPACKQuantizer().set_global(get_symmetric_quantization_config(is_per_channel=True, is_dynamic=True))
        return hx.PT2EQuantizer(xnnpack)
    # Dynamo, and ExecuTorch int4: NNCF weight compression of the FX graph.
    return hx.NNCFTorchFXQuantizer(int8 if precision == "int8" else int4)


class PeakRss:
    """Peak resident memory while the block runs, over the process's at its start (polled every 20 ms)."""

    def __enter__(self) -> PeakRss:
        self.start = self.peak = _rss_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def _poll(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _rss_bytes())

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())

    @property
    def megabytes(self) -> float:
        return (self.peak - self.start) / 1e6


@dataclass
class Row:
    """One line of the table."""

    run: str
    precision: str
    ttft: float = float("nan")
    tps: float = float("nan")
    tokens: str = ""
    export_s: float = float("nan")
    peak_mb: float = float("nan")
    note: str = ""


COLUMNS = (
    "run",
    "precision",
    "TTFT ms",
    "decode tok/s",
    "% of ceiling",
    "x eager",
    "tokens",
    "export s",
    "peak MB",
    "note",
)


def table(rows: list[Row], ceiling: float) -> str:
    """The Markdown table of `rows`; the first row is eager fp32 (the x eager reference)."""
    eager = rows[0].tps
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        share = 100 * r.tps / (ceiling * 32 / BITS[r.precision])
        cells = (
            r.run,
            r.precision,
            f"{r.ttft * 1e3:.0f}",
            f"{r.tps:.1f}",
            f"{share:.0f}%",
            f"{r.tps / eager:.2f}",
            r.tokens,
            f"{r.export_s:.0f}",
            f"{r.peak_mb:.0f}",
            r.note,
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def matvec_bandwidth(megabytes: int = 512, repeats: int = 10) -> float:
    """Bytes per second that `torch.mv` streams from a fp32 matrix of `megabytes` (the decode-bound kernel)."""
    cols = 4096
    rows = megabytes * 1024 * 1024 // (4 * cols)
    matrix = torch.randn(rows, cols)
    vector = torch.randn(cols)
    torch.mv(matrix, vector)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mv(matrix, vector)
        times.append(time.perf_counter() - start)
    return matrix.numel() * 4 / statistics.median(times)


def weight_bytes_per_token(model: torch.nn.Module) -> int:
    """Bytes of weights one decode step reads: every parameter once (a tied head shares the embedding's)."""
    seen: set[int] = set()
    total = 0
    for param in model.parameters():
        if param.data_ptr() not in seen:
            seen.add(param.data_ptr())
            total += param.numel() * param.element_size()
    # The input embedding is a gather (one row per token), not a full read, unless the head reuses it.
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    if head is None or head.weight.data_ptr() != embed.data_ptr():
        total -= embed.numel() * embed.element_size()
    return total


def timed(fn: Callable[[int], Any], new: int, repeats: int) -> tuple[float, float]:
    """(TTFT seconds, decode tokens/s) of `fn(max_new_tokens)`, medians over `repeats`."""
    fn(2)  # warm up: sessions, allocations
    first = statistics.median(_time(lambda: fn(1)) for _ in range(repeats))
    full = statistics.median(_time(lambda: fn(new)) for _ in range(repeats))
    return first, (new - 1) / max(full - first, 1e-9)


def _time(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    # openvino-stateful: OpenVINOConfig(stateful=True), the cache kept in the infer request (vs openvino's fed back).
    parser.add_argument("--backends", default="onnx,executorch,openvino,openvino-stateful,dynamo")
    parser.add_argument("--precisions", default="fp32,int8,int4")
    parser.add_argument("--no-peer", action="store_true")
    parser.add_argument("--quick", action="store_true", help="2 layers, 16-token prompt, 8 new tokens, 1 repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.prompt, args.new, args.repeats = 2, 16, 8, 1

    from transformers import GenerationConfig

    from hfexport import AutoExportConfig, AutoHfExporter
    from hfexport.runtime.generation import generate

    model = build_model(args.layers)
    prompt = torch.randint(3, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompt)
    slots = args.prompt + args.new
    bandwidth = matvec_bandwidth(64 if args.quick else 512, 3 if args.quick else 10)
    per_token = weight_bytes_per_token(model)
    ceiling = bandwidth / per_token
    load = os.getloadavg()[0]
    print(
        f"torch threads {torch.get_num_threads()}; load {load:.1f}; matvec bandwidth {bandwidth / 1e9:.1f} GB/s; "
        f"weights read per token {per_token / 1e6:.0f} MB; fp32 decode ceiling {ceiling:.1f} tok/s",
        flush=True,
    )

    def eager(n: int) -> Any:
        with torch.no_grad():
            return model.generate(
                input_ids=prompt,
                attention_mask=mask,
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )

    ttft, tps = timed(eager, args.new, args.repeats)
    rows = [Row("eager generate (dynamic cache)", "fp32", ttft, tps, "reference")]
    print(f"eager: ttft {ttft * 1e3:.0f} ms, {tps:.1f} tok/s", flush=True)
    expected = eager(args.new)

    static = GenerationConfig(cache_implementation="static", max_cache_len=slots)
    sample = {"input_ids": prompt[:, :8], "attention_mask": mask[:, :8]}
    for backend in [b for b in args.backends.split(",") if b]:
        for precision in [p for p in args.precisions.split(",") if p]:
            row = Row(f"hfexport {backend} (static cache)", precision)
            rows.append(row)
            try:
                settings = dict(VARIANTS.get(backend, {"export_format": backend, "dynamic": True}))
                config = AutoExportConfig.from_dict(settings)
                quantizer = _quantizer(backend, precision)
                if quantizer is not None:
                    config = dataclasses.replace(config, quantizer=quantizer)
                start = time.perf_counter()
                with PeakRss() as memory:
                    components = AutoHfExporter.from_config(config).export_for_generation(
                        model, sample, config, generation_config=static, multi_token_decode=True
                    )
                row.export_s, row.peak_mb = time.perf_counter() - start, memory.megabytes

                def run(n: int, components: Any = components) -> Any:
                    return generate(components, prompt, mask, max_new_tokens=n, min_new_tokens=n)

                got = run(args.new)
                same = int((got[:, args.prompt :] == expected[:, args.prompt :]).sum())
                row.tokens = "equal" if torch.equal(got, expected) else f"{same}/{args.new} equal"
                row.ttft, row.tps = timed(run, args.new, args.repeats)
                print(
                    f"{backend} {precision}: ttft {row.ttft * 1e3:.0f} ms, {row.tps:.1f} tok/s, {row.tokens}",
                    flush=True,
                )
            except Exception as exc:  # a backend that cannot run is a row, not the end of the benchmark
                traceback.print_exc()
                row.note = f"{type(exc).__name__}: {exc}"[:120].replace("|", "/").replace("\n", " ")
    if not args.no_peer:
        rows.append(_peer(model, sample, static, prompt, mask, args))

    print(f"\nload {load:.1f} -> {os.getloadavg()[0]:.1f} (1-minute average at start and end)")
    print(table(rows, ceiling))
    return 0


def _peer(model: Any, sample: Any, static: Any, prompt: Any, mask: Any, args: Any) -> Row:
    """transformers.exporters' ONNX export of the same single decode graph, driven by a plain ORT loop."""
    try:
        import onnxruntime as ort
        from transformers.exporters import OnnxConfig, OnnxExporter

        start = time.perf_counter()
        with PeakRss() as memory:
            exported = OnnxExporter().export_for_generation(
                model, sample, OnnxConfig(dynamic=True), generation_config=static, multi_token_decode=True
            )
        export_s = time.perf_counter() - start
        program = exported.components["decode"].program
        proto = program.model_proto if hasattr(program, "model_proto") else __import__("onnx_ir").to_proto(program)
        session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        slots = args.prompt + args.new
        cache_inputs = [i for i in session.get_inputs() if i.name.startswith("input.")]

        def run(n: int) -> Any:
            import numpy as np

            cache = {
                i.name: np.zeros(
                    [slots if isinstance(d, str) else d for d in i.shape],
                    dtype=np.float32 if "float" in i.type else np.int64,
                )
                for i in cache_inputs
            }
            ids = prompt.numpy()
            length = ids.shape[1]
            out_ids = [ids]
            position = 0
            for _ in range(n):
                q = ids.shape[1]
                positions = np.arange(position, position + q)[None]
                attention = (np.arange(slots)[None, :] <= positions[0][:, None])[None, None]
                feed = {"input_ids": ids, "attention_mask": attention, "position_ids": positions, **cache}
                names = [o.name for o in session.get_outputs()]
                results = dict(
                    zip(
                        names,
                        session.run(
                            None, {k: v for k, v in feed.items() if k in {i.name for i in session.get_inputs()}}
                        ),
                        strict=True,
                    )
                )
                for name in list(cache):
                    cache[name] = results["output." + name[len("input.") :]]
                ids = results[next(k for k in names if k.endswith("logits"))][:, -1:].argmax(-1)
                out_ids.append(ids)
                position += q
            return np.concatenate(out_ids, 1)[:, : length + n]

        ttft, tps = timed(run, args.new, args.repeats)
        return Row("peer transformers.exporters onnx", "fp32", ttft, tps, "", export_s, memory.megabytes)
    except Exception as exc:
        traceback.print_exc()
        note = f"{type(exc).__name__}: {exc}"[:120].replace("|", "/").replace("\n", " ")
        return Row("peer transformers.exporters onnx", "fp32", note=note)


if __name__ == "__main__":
    sys.exit(main())
