"""Our quantization recipes beside the peers' on the trained code model: accuracy and decode speed, one run.

    nice -n 10 python tools/peer_accuracy.py --sweep quant-accuracy.json \
        [--peers DIR] [--only onnxruntime-genai,optimum-intel] [--json peers.json]

Each peer recipe runs in the peer's own virtual environment (`<peers>/<peer>/bin/python tools/peers/run_peer.py`,
which never imports hfexport): it builds the peer's quantized model from `tests/fixtures/code_lm`, and returns its
logits on the same 16 windows of 128 tokens of `heldout.txt` that `tools/quant_accuracy.py` measures ours on, its
greedy tokens after the same two 32-token prompts, and the decode speed of its own generation loop. Here they are
compared with the float model exactly as `hfexport.quantization_accuracy` compares ours (`LogitComparison`).
Our rows' accuracy comes from the sweep's JSON (`--sweep`); their decode speed from `hfexport.apps.bench`'s recipes
(`bench_generation`, in this process). Speed: batch 1, a 32-token random prompt (the bench's, seed 1), 64 new
tokens, decode tokens/s = 63 / (t(64) - t(1)), median of 3; every row in one run, one after the other, on a
shared machine (the load average is recorded).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "code_lm"
SPEED_PROMPT, SPEED_NEW = 32, 64
# (peer, recipe, precision, what it is)
PEER_RECIPES = [
    (
        "onnxruntime-genai",
        "int4",
        "int4",
        "builder -p int4 (MatMulNBits, blocks of 32, symmetric; accuracy_level 4: int8 activations)",
    ),
    ("onnxruntime-genai", "int4-acc1", "int4", "builder -p int4, accuracy_level=1 (float activations)"),
    ("onnxruntime-genai", "int8", "int8-weights", "builder -p int8 (8-bit MatMulNBits; accuracy_level 4)"),
    ("optimum-intel", "int8", "int8-weights", "OVWeightQuantizationConfig(bits=8) (per channel, asymmetric)"),
    ("optimum-intel", "int8-f32", "int8-weights", "the same, INFERENCE_PRECISION_HINT=f32"),
    ("optimum-intel", "int4", "int4", "OVWeightQuantizationConfig(bits=4) (asymmetric, groups of 128)"),
    ("optimum-intel", "int4-f32", "int4", "the same, INFERENCE_PRECISION_HINT=f32"),
    ("optimum-intel", "int4-sym-g32-f32", "int4", "bits=4, sym=True, group_size=32, f32 hint"),
    ("optimum-intel", "int4-awq-se-f32", "int4", "bits=4, sym, group 32, AWQ + scale estimation on 16 texts, f32 hint"),
    ("optimum-executorch", "8da4w", "int4", "qlinear=8da4w (int8 dynamic activations, int4 weights in groups of 32)"),
]
# Our recipes to set beside them: (backend, recipe name in the sweep, bench precision or None).
OURS = [
    ("onnx", "bench int4", "int4"),
    ("onnx", "NNCFOnnx int4_sym g32", None),
    ("onnx", "bench int8", "int8"),
    ("onnx", "NNCFOnnx int8_asym weights", None),
    ("openvino", "bench int8", "int8"),
    ("openvino", "NNCFOpenVINO int4_sym g32", None),
    ("openvino", "bench int4", "int4"),
    ("openvino", "NNCFOpenVINO int4_sym g32 AWQ + scale estimation", None),
    ("executorch", "bench int4", "int4"),
    ("executorch", "bench int8", "int8"),
]


def inputs_file(tokenizer: Any, vocab: int, folder: Path) -> tuple[Path, torch.Tensor, torch.Tensor]:
    """The windows, prompts, speed prompt and calibration texts, as the peers' script reads them."""
    from hfexport.artifacts.accuracy import eval_tokens
    from hfexport.artifacts.eval_text import read_stdlib

    tokens = eval_tokens((FIXTURE / "heldout.txt").read_text(), tokenizer, vocab, 16, 128, "heldout.txt")
    prompts = tokens.windows[:2, :32].contiguous()
    speed = torch.randint(min(3, vocab - 1), vocab, (1, SPEED_PROMPT), generator=torch.Generator().manual_seed(1))
    corpus = read_stdlib()
    calibration = [corpus.texts[name][:2000] for name in corpus.train[::43]][:16]
    path = folder / "inputs.npz"
    np.savez(
        path,
        windows=tokens.windows.numpy(),
        prompts=prompts.numpy(),
        new=32,
        speed_prompt=speed[0].numpy(),
        speed_new=SPEED_NEW,
        calibration=json.dumps(calibration),
    )
    return path, tokens.windows, prompts


def decode_rate(first: list[float], full: list[float]) -> float:
    return (SPEED_NEW - 1) / (statistics.median(full) - statistics.median(first))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", type=Path, required=True, help="tools/quant_accuracy.py's JSON (our rows)")
    parser.add_argument(
        "--peers",
        type=Path,
        default=Path(os.environ.get("HFEXPORT_PEERS", Path.home() / ".cache" / "hfexport-peers")),
        help="the peers' virtual environments, as tools/peers/setup.sh installs them ($HFEXPORT_PEERS or "
        "~/.cache/hfexport-peers)",
    )
    parser.add_argument("--only", help="comma-separated peers")
    parser.add_argument("--no-ours", action="store_true", help="skip our decode-speed runs")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hfexport.artifacts.accuracy import FloatModel, LogitComparison

    model = AutoModelForCausalLM.from_pretrained(FIXTURE, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(FIXTURE, local_files_only=True)
    vocab = model.config.vocab_size
    work = Path(tempfile.mkdtemp(prefix="peer-accuracy-"))
    inputs, windows, prompts = inputs_file(tokenizer, vocab, work)
    reference = FloatModel(model)
    float_logits = torch.cat([reference.logits(windows[i : i + 4]) for i in range(0, len(windows), 4)])
    float_greedy = reference.greedy(prompts, 32)
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    loads = [os.getloadavg()[0]]
    peers = [r for r in PEER_RECIPES if not args.only or r[0] in args.only.split(",")]
    for peer, recipe, precision, what in peers:
        out = work / f"{peer}-{recipe}.npz"
        python = args.peers / peer / "bin" / "python"
        command = [str(python), str(ROOT / "tools" / "peers" / "run_peer.py"), "--peer", peer, "--recipe", recipe]
        command += ["--model", str(FIXTURE), "--inputs", str(inputs), "--work", str(work), "--out", str(out)]
        print(f"--- {peer} {recipe}", file=sys.stderr, flush=True)
        row: dict[str, Any] = {"who": peer, "recipe": recipe, "what": what}
        result = subprocess.run(command, capture_output=True, text=True, timeout=3600)
        loads.append(os.getloadavg()[0])
        if result.returncode != 0:
            row["error"] = (result.stderr.strip().splitlines() or ["failed"])[-1][:300]
            print(result.stderr[-3000:], file=sys.stderr)
            rows.append(row)
            continue
        data = np.load(out)
        sums = LogitComparison()
        sums.add(windows, float_logits, torch.from_numpy(data["logits"]))
        record = sums.record(
            vocab_size=vocab,
            precision=precision,
            text="heldout.txt, 16 x 128 tokens",
            greedy=(float_greedy, torch.from_numpy(data["greedy"])),
        )
        row.update(
            accuracy=record.to_dict(),
            decode_tokens_per_s=round(decode_rate(list(data["first"]), list(data["full"])), 1),
            export_seconds=round(float(data["export_seconds"]), 1),
        )
        print(f"    {record.summary()}; decode {row['decode_tokens_per_s']} tok/s", file=sys.stderr, flush=True)
        rows.append(row)

    sweep = {(r["backend"], r["recipe"], r["path"]): r for r in json.loads(args.sweep.read_text())["rows"]}
    speeds: dict[tuple[str, str], float] = {}
    if not args.no_ours:
        from hfexport.apps.bench import bench_generation

        for backend in ("onnx", "openvino", "executorch"):
            result = bench_generation(
                model, backends=(backend,), precisions=("int8", "int4"), prompt=SPEED_PROMPT, new=SPEED_NEW
            )
            loads.append(os.getloadavg()[0])
            for bench_row in result.rows:
                # The bench names its rows "hfexport <backend> (<cache> cache)"; a row that failed has no rate.
                rate = bench_row.tokens_per_s
                if bench_row.run.startswith(f"hfexport {backend} ") and not math.isnan(rate):
                    speeds[(backend, bench_row.precision)] = round(rate, 1)
    for backend, name, bench in OURS:
        ours = sweep.get((backend, name, "export"), {})
        row = {"who": f"hfexport {backend}", "recipe": name, "what": json.dumps(ours.get("settings", {}))}
        if "accuracy" in ours:
            row["accuracy"] = ours["accuracy"]
        else:
            row["error"] = ours.get("error", "not in the sweep")
        if bench is not None and (backend, bench) in speeds:
            row["decode_tokens_per_s"] = speeds[(backend, bench)]
        rows.append(row)
    document = {
        "model": "tests/fixtures/code_lm",
        "minutes": round((time.perf_counter() - started) / 60, 1),
        "load_average": [round(x, 1) for x in loads],
        "rows": rows,
    }
    if args.json:
        args.json.write_text(json.dumps(document, indent=2) + "\n")
    print(table(rows))
    return 0


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| who | recipe | perplexity change | KL | top-1 | greedy diverges | decode tok/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        a = row.get("accuracy")
        speed = row.get("decode_tokens_per_s", "")
        if a is None:
            lines.append(f"| {row['who']} | {row['recipe']} | failed: {row.get('error', '')[:100]} | | | | |")
            continue
        first = "never" if a["first_divergence"] is None else f"at {a['first_divergence']}"
        lines.append(
            f"| {row['who']} | {row['recipe']} | {a['perplexity_change']:+.2%} | {a['kl_divergence']:.4f} | "
            f"{a['top1_agreement']:.1%} | {first} | {speed} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
