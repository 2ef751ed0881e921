"""ONNX export benchmark: hfexport vs transformers' own exporter on a SmolLM2-135M-shaped Llama.

Each export runs in its own subprocess (so peak memory is that export's alone): export time and peak
resident memory over the model's own footprint. Both graphs are then timed in ONNX Runtime (CPU) on one
prefill of `--tokens` tokens, batch 1, against eager PyTorch in the same process, and their logits are
compared with eager. Prints a table and the ratios ours/peer (below 1 is better for us).

    python tools/bench_onnx.py [--tokens 128] [--calls 20] [--layers 30]

Random weights (seed 0): this measures exporters and graphs, not model quality. The peer,
`transformers.exporters.OnnxExporter`, is imported by this tool only, never by hfexport.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# SmolLM2-135M's shape (HuggingFaceTB/SmolLM2-135M config.json), written out: nothing is downloaded.
SMOLLM2_135M: dict[str, Any] = {
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
    "hidden_act": "silu",
}


def build_model(layers: int) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**{**SMOLLM2_135M, "num_hidden_layers": layers})
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).eval()


def sample_inputs(tokens: int) -> dict[str, Any]:
    import torch

    ids = torch.randint(0, SMOLLM2_135M["vocab_size"], (1, tokens), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def export_child(which: str, path: str, layers: int, tokens: int) -> None:
    """Run in a subprocess: export once, save to `path`, print a JSON line with time and peak memory."""
    model, inputs = build_model(layers), sample_inputs(tokens)
    before = _rss_bytes()
    start = time.perf_counter()
    if which == "ours":
        from hfexport import OnnxConfig, OnnxExporter

        OnnxExporter().export(model, inputs, config=OnnxConfig(dynamic=True, output_path=path))
    else:
        from transformers import exporters as peer

        exported = peer.OnnxExporter().export(model, inputs, peer.OnnxConfig(dynamic=True, ort_fusions="cpu"))
        program = exported.program
        if hasattr(program, "save"):
            program.save(path)
        else:  # an onnx_ir.Model
            import onnx_ir as ir

            ir.save(program, path, external_data=Path(path).name + ".data")
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux
    print(json.dumps({"seconds": seconds, "peak_mb": max(0, peak - before) / 2**20}))


def run_export(which: str, path: Path, layers: int, tokens: int) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", which, "--path", str(path), "--layers", str(layers)]
    command += ["--tokens", str(tokens)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        return {"error": " / ".join(tail) or f"exit {done.returncode}"}
    return json.loads(lines[-1])


def _median_ms(fn: Any, calls: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def ort_latency(path: Path, inputs: dict[str, Any], calls: int) -> tuple[float, Any, dict[str, int]]:
    """Median ORT CPU latency of one call, the logits, and the count of contrib / fused op types."""
    import onnx
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feed = {i.name: inputs[i.name].numpy() for i in session.get_inputs()}
    names = [o.name for o in session.get_outputs()]
    logits_index = next(i for i, n in enumerate(names) if n.endswith("logits"))
    logits = session.run(None, feed)[logits_index]
    ops: dict[str, int] = {}
    for node in onnx.load(str(path), load_external_data=False).graph.node:
        if node.domain or node.op_type in ("Attention", "RotaryEmbedding", "Gelu", "SimplifiedLayerNormalization"):
            ops[node.op_type] = ops.get(node.op_type, 0) + 1
    return _median_ms(lambda: session.run(None, feed), calls), logits, ops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--layers", type=int, default=SMOLLM2_135M["num_hidden_layers"])
    parser.add_argument("--child", choices=("ours", "peer"))
    parser.add_argument("--path")
    args = parser.parse_args()
    if args.child:
        export_child(args.child, args.path, args.layers, args.tokens)
        return

    import numpy as np
    import torch

    rows: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for which in ("ours", "peer"):
            path = Path(tmp) / which / "model.onnx"
            path.parent.mkdir()
            print(f"exporting ({which}) ...", file=sys.stderr, flush=True)
            rows[which] = {"path": path, **run_export(which, path, args.layers, args.tokens)}

        model, inputs = build_model(args.layers), sample_inputs(args.tokens)
        with torch.no_grad():
            expected = model(**inputs).logits.numpy()
            eager_ms = _median_ms(lambda: model(**inputs), args.calls)
        for row in rows.values():
            if "error" not in row:
                row["ms"], logits, row["ops"] = ort_latency(row["path"], inputs, args.calls)
                row["max_diff"] = float(np.abs(logits - expected).max())

    print(f"SmolLM2-135M-shaped Llama, {args.layers} layers, random weights; prefill {args.tokens} tokens, batch 1")
    print(f"torch {torch.__version__}, eager {eager_ms:.1f} ms\n")
    print("| exporter | export s | peak MB | ORT ms | max abs diff vs eager | fused ops |")
    print("|---|---|---|---|---|---|")
    for which, row in rows.items():
        if "error" in row:
            print(f"| {which} | failed: {row['error']} | | | | |")
            continue
        ops = ", ".join(f"{k} {v}" for k, v in sorted(row["ops"].items()))
        cells = [which, f"{row['seconds']:.1f}", f"{row['peak_mb']:.0f}", f"{row['ms']:.1f}", f"{row['max_diff']:.2g}"]
        print("| " + " | ".join([*cells, ops]) + " |")
    ours, peer = rows["ours"], rows["peer"]
    if "error" not in ours and "error" not in peer:
        print(
            f"\nours/peer: export time {ours['seconds'] / peer['seconds']:.2f}x, peak memory "
            f"{ours['peak_mb'] / max(peer['peak_mb'], 1e-9):.2f}x, ORT latency {ours['ms'] / peer['ms']:.2f}x; "
            f"ORT/eager: ours {ours['ms'] / eager_ms:.2f}x, peer {peer['ms'] / eager_ms:.2f}x"
        )


if __name__ == "__main__":
    main()
