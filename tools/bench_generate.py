"""Generation benchmark: decode tokens/s and time to first token, eager vs the peer vs hfexport per backend.

    python tools/bench_generate.py [--prompt 128] [--new 128] [--layers 30] [--backends onnx,executorch,...]

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
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from bench_onnx import build_model  # tools/ is on sys.path when this script runs

# Backend rows that are a config variant of a format rather than the format's defaults.
VARIANTS: dict[str, dict[str, Any]] = {
    "openvino-stateful": {"export_format": "openvino", "dynamic": True, "stateful": True},
}


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
    parser.add_argument("--no-peer", action="store_true")
    args = parser.parse_args(argv)

    from transformers import GenerationConfig

    from hfexport import AutoExportConfig, AutoHfExporter
    from hfexport.runtime.generation import generate

    model = build_model(args.layers)
    prompt = torch.randint(3, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(prompt)
    slots = args.prompt + args.new
    bandwidth = matvec_bandwidth()
    per_token = weight_bytes_per_token(model)
    ceiling = bandwidth / per_token
    print(
        f"torch threads {torch.get_num_threads()}; matvec bandwidth {bandwidth / 1e9:.1f} GB/s; "
        f"weights read per token {per_token / 1e6:.0f} MB; decode ceiling {ceiling:.1f} tok/s",
        flush=True,
    )

    rows: list[tuple[str, float, float, str]] = []

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
    rows.append(("eager generate (dynamic cache)", ttft, tps, ""))
    print(f"eager: ttft {ttft * 1e3:.0f} ms, {tps:.1f} tok/s", flush=True)
    expected = eager(args.new)

    static = GenerationConfig(cache_implementation="static", max_cache_len=slots)
    sample = {"input_ids": prompt[:, :8], "attention_mask": mask[:, :8]}
    for backend in [b for b in args.backends.split(",") if b]:
        try:
            config = AutoExportConfig.from_dict(VARIANTS.get(backend, {"export_format": backend, "dynamic": True}))
            start = time.perf_counter()
            components = AutoHfExporter.from_config(config).export_for_generation(
                model, sample, config, generation_config=static, multi_token_decode=True
            )
            export_s = time.perf_counter() - start

            def run(n: int, components: Any = components) -> Any:
                return generate(components, prompt, mask, max_new_tokens=n, min_new_tokens=n)

            same = torch.equal(run(args.new), expected)
            ttft, tps = timed(run, args.new, args.repeats)
            note = f"export {export_s:.0f} s; tokens {'equal' if same else 'DIFFER'} to eager"
            rows.append((f"hfexport {backend} (static cache)", ttft, tps, note))
            print(f"{backend}: ttft {ttft * 1e3:.0f} ms, {tps:.1f} tok/s ({note})", flush=True)
        except Exception as exc:  # a backend that cannot run is a row, not the end of the benchmark
            traceback.print_exc()
            rows.append((f"hfexport {backend}", float("nan"), float("nan"), f"{type(exc).__name__}: {exc}"[:120]))
    if not args.no_peer:
        rows.append(_peer(model, sample, static, prompt, mask, args))

    eager_tps = rows[0][2]
    print("\n| run | TTFT ms | decode tok/s | × eager | % of ceiling | note |\n|---|---|---|---|---|---|")
    for name, ttft, tps, note in rows:
        print(
            f"| {name} | {ttft * 1e3:.0f} | {tps:.1f} | {tps / eager_tps:.2f} | {100 * tps / ceiling:.0f}% | {note} |"
        )
    return 0


def _peer(model: Any, sample: Any, static: Any, prompt: Any, mask: Any, args: Any) -> tuple[str, float, float, str]:
    """transformers.exporters' ONNX export of the same single decode graph, driven by a plain ORT loop."""
    try:
        import onnxruntime as ort
        from transformers.exporters import OnnxConfig, OnnxExporter

        start = time.perf_counter()
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
        return ("peer transformers.exporters onnx (static cache)", ttft, tps, f"export {export_s:.0f} s")
    except Exception as exc:
        traceback.print_exc()
        return ("peer transformers.exporters onnx", float("nan"), float("nan"), f"{type(exc).__name__}: {exc}"[:120])


if __name__ == "__main__":
    sys.exit(main())
