"""Generation benchmark: decode tokens/s and time to first token, eager vs the peer vs hfexport per backend.

    python tools/bench_generate.py [--prompt 128] [--new 128] [--layers 30] [--backends onnx,executorch,...]
        [--precisions fp32,int8,int4] [--quick]

`--quick`: a 2-layer model, a 16-token prompt, 8 new tokens, one repeat (a smoke run of the whole table; its
timings mean nothing). One table row per backend x precision: TTFT, decode tok/s, % of that precision's
ceiling, x eager, tokens vs eager (fp32 eager), export seconds and the export's peak RSS over the process's
before it (polled every 20 ms). Quantized rows use each backend's weight-only (or dynamic) recipe
(`hfexport.apps.bench.quantizer_for`: int8 with dynamic activations on ONNX Runtime and XNNPACK; int4 on ExecuTorch
is torchao's 8da4w, dynamic int8 activations with int4 weights in groups of 32, elsewhere NNCF int4 weights in
groups of 32); their ceiling is the fp32 one times 32/bits (nominal: scales and the unquantized embedding gather are not
counted).

SmolLM2-135M-shaped Llama (random weights, seed 0), batch 1. Rows: eager `model.generate` (dynamic cache),
the peer (`transformers.exporters`, ONNX, driven by the same loop where it can run), and hfexport's
`export_for_generation` + `hfexport.runtime.generate` per backend (static cache of prompt + new slots, one
multi-token decode graph); `openvino-stateful` is OpenVINO with the cache kept in the infer request
(`OpenVINOConfig(stateful=True)`), beside `openvino`, which feeds it back every step. `executorch-static-decode`
(not run by default) exports a dynamic prefill and a one-token decode graph static at batch 1 (docs/executorch.md).
TTFT is a 1-token generate; decode tok/s is (new - 1) / (time(new) - TTFT).
The same run measures this machine's matrix-vector bandwidth (fp32 `torch.mv` over a matrix far larger
than cache) and the decode ceiling it implies: bandwidth / weight bytes read per token.

The measurement is `hfexport.apps.bench.bench_generation` (also `hfexport bench --model ...` on a user's model); this
tool adds the SmolLM2-135M shape and the peer's row, which the package may not import.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from bench_onnx import build_model  # tools/ is on sys.path when this script runs

from hfexport.apps.bench import BenchRow, PeakRss, bench_generation, timed


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
    parser.add_argument("--json", help="also write the rows, the bandwidth and the load to this file")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.prompt, args.new, args.repeats = 2, 16, 8, 1

    model = build_model(args.layers)
    result = bench_generation(
        model,
        backends=[b for b in args.backends.split(",") if b],
        precisions=[p for p in args.precisions.split(",") if p],
        prompt=args.prompt,
        new=args.new,
        repeats=args.repeats,
        bandwidth_mb=64 if args.quick else 512,
        on_step=lambda message: print(message, flush=True),
    )
    if not args.no_peer:
        result.rows.append(_peer(model, result.prompt, result.new, args.repeats))
    print()
    print(result.summary())
    print(result.table())
    if args.json:
        record = {**result.to_dict(), "layers": args.layers, "repeats": args.repeats}
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    return 0


def _peer(model: Any, prompt_length: int, new: int, repeats: int) -> BenchRow:
    """transformers.exporters' ONNX export of the same single decode graph, driven by a plain ORT loop."""
    row = BenchRow("peer transformers.exporters onnx", "fp32")
    try:
        import onnxruntime as ort
        import torch
        from transformers import GenerationConfig
        from transformers.exporters import OnnxConfig, OnnxExporter

        vocab = model.config.vocab_size
        prompt = torch.randint(min(3, vocab - 1), vocab, (1, prompt_length), generator=torch.Generator().manual_seed(1))
        sample = {"input_ids": prompt[:, :8], "attention_mask": torch.ones_like(prompt[:, :8])}
        static = GenerationConfig(cache_implementation="static", max_cache_len=prompt_length + new)

        start = time.perf_counter()
        with PeakRss() as memory:
            exported = OnnxExporter().export_for_generation(
                model, sample, OnnxConfig(dynamic=True), generation_config=static, multi_token_decode=True
            )
        # Kept on the row even when the graph then fails to run: the peer's export time is goal 5's reference.
        row.export_s, row.peak_mb = time.perf_counter() - start, memory.megabytes
        program = exported.components["decode"].program
        proto = program.model_proto if hasattr(program, "model_proto") else __import__("onnx_ir").to_proto(program)
        session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
        slots = prompt_length + new
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

        row.ttft_s, row.tokens_per_s = timed(run, new, repeats)
    except Exception as exc:
        traceback.print_exc()
        row.note = f"{type(exc).__name__}: {exc}"[:120].replace("|", "/").replace("\n", " ")
    return row


if __name__ == "__main__":
    sys.exit(main())
