"""Peak memory and time of an ONNX export with and without `--low-memory`, on a Llama-shaped checkpoint.

    python tools/bench_low_memory.py                       # small (SmolLM2 width, 4 layers), both paths
    python tools/bench_low_memory.py --target-gb 1         # SmolLM2-135M width, layers added to reach ~1 GB
    python tools/bench_low_memory.py --shape wide          # TinyLlama-1.1B width, 4 layers: 1.2 GB
    python tools/bench_low_memory.py --shape llama7b --target-gb 8 --limit-gb 3 --formats onnx,openvino
                                                           # the issue's 8 GB / 3 GB run
    python tools/bench_low_memory.py --target-gb 1 --formats onnx,openvino --quantize int4_sym
                                                           # NNCF weight compression on both paths

Writes a sharded safetensors checkpoint of random weights (fixed seed; SmolLM2-135M shape by default: hidden
576, 9 heads, 3 kv heads, intermediate 1536, vocab 49152, tied embeddings; `--target-gb` sets the number of
layers so that the float32 checkpoint has about that size), written tensor by tensor so this tool never holds
it either. Each export (`--formats onnx,openvino`) runs in a child process (in-memory: `from_pretrained`; low-memory:
`empty_model` and `low_memory=True`); the parent polls the child's resident memory (VmRSS, every 20 ms) and kills
it once it passes `--limit-gb`, so a path that needs the model in memory fails instead of swapping. The limit is
on resident memory, not address space (`prlimit --as`): the OpenVINO path's placeholders are anonymous maps
that reserve address space without memory, and torch/OpenVINO reserve large arenas. A cgroup memory limit would
need a cgroup created in the container's hierarchy, which belongs to the machine, not to this tool. Prints and
returns peak RSS (the poll and the child's VmHWM), the peak per export stage (a thread in the child samples VmRSS
every 5 ms; OpenVINO's C++ calls that hold the GIL escape it, VmHWM does not), wall time per path, the import
baseline (peak RSS of a process importing every module the export imported), and the ratios low-memory /
in-memory of the whole process and above that baseline; the low-memory artifact's weights are checked byte for
byte against the checkpoint (`check_streamed_weights`, one tensor at a time).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SMOLLM2 = {
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
}


# A wide shape (TinyLlama-1.1B's width, untied embeddings): about 1.2 GB in 4 layers, so the export time (which
# grows with the number of layers) stays short while the weights dominate memory.
WIDE = {
    **SMOLLM2,
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "intermediate_size": 5632,
    "vocab_size": 32000,
    "tie_word_embeddings": False,
}
# Llama-2-7B's width (hidden 4096, 32 heads, intermediate 11008, vocab 32000, untied): 0.81 GB a layer in float32,
# so an ~8 GB checkpoint has 9 layers (the 8 GB / 3 GB run; the export time grows with the layers).
LLAMA7B = {
    **SMOLLM2,
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "intermediate_size": 11008,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "rope_theta": 10000.0,
}
SHAPES = {"smollm2": SMOLLM2, "wide": WIDE, "llama7b": LLAMA7B}


def layers_for(target_gb: float, shape: dict[str, Any]) -> int:
    """Layers that make a float32 checkpoint of `shape` about `target_gb` GB."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    kv = hidden // shape["num_attention_heads"] * shape["num_key_value_heads"]
    per_layer = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter + 2 * hidden
    embed = shape["vocab_size"] * hidden * (1 if shape["tie_word_embeddings"] else 2)
    return max(1, round((target_gb * 1e9 / 4 - embed) / per_layer))


def write_checkpoint(folder: Path, shape: dict[str, Any], shard_bytes: int = 500_000_000, seed: int = 0) -> int:
    """A checkpoint of random weights in safetensors shards of about `shard_bytes`; returns its bytes."""
    import torch
    import transformers
    from safetensors.torch import save_file

    config = transformers.LlamaConfig(**shape)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    names = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if config.tie_word_embeddings:
        names.pop("lm_head.weight", None)  # save_pretrained writes a tied weight once
    generator = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    shard: dict[str, Any] = {}
    size, total, index = 0, 0, 0

    def flush() -> None:
        nonlocal shard, size, index
        if shard:
            index += 1
            file = f"model-{index:05d}.safetensors"
            save_file(shard, str(folder / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(shard, file))
            shard, size = {}, 0

    for name, tensor_shape in names.items():
        if name.endswith("norm.weight"):
            tensor = 1 + 0.1 * torch.randn(tensor_shape, generator=generator)
        else:
            tensor = 0.02 * torch.randn(tensor_shape, generator=generator)
        shard[name] = tensor
        size += tensor.numel() * 4
        total += tensor.numel() * 4
        if size >= shard_bytes:
            flush()
    flush()
    # Final names: model-0000i-of-0000n, as save_pretrained writes them.
    renamed = {}
    for i in range(1, index + 1):
        old, new = f"model-{i:05d}.safetensors", f"model-{i:05d}-of-{index:05d}.safetensors"
        (folder / old).rename(folder / new)
        renamed[old] = new
    index_json = {"metadata": {"total_size": total}, "weight_map": {k: renamed[v] for k, v in weight_map.items()}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index_json, indent=1))
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(folder)
    return total


CHILD = r"""
import json, os, sys, threading, time
from pathlib import Path
folder, out, low, fmt = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]

def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1e6

# Resident memory per stage: a thread samples VmRSS every 5 ms and keeps the largest value seen in each stage
# (the stage the export's stage listener last announced; "build" and "save" are this script's own).
stage, peaks, done = ["imports"], {}, threading.Event()
def sample():
    while not done.is_set():
        rss = status("VmRSS")
        peaks[stage[0]] = max(peaks.get(stage[0], 0.0), rss)
        time.sleep(0.005)
threading.Thread(target=sample, daemon=True).start()
modules_out = None if sys.argv[5] == "-" else sys.argv[5]
mode, group = (sys.argv[6], int(sys.argv[7])) if len(sys.argv) > 6 else (None, None)
start = time.perf_counter()
import torch
from hfexport import OnnxConfig, OnnxExporter, OpenVINOConfig, OpenVINOExporter, empty_model, save
from hfexport.rewrites.engine import stage_listener
imports = {"rss_gb": status("VmRSS"), "hwm_gb": status("VmHWM"), "s": time.perf_counter() - start}
stage[0] = "build"
if low:
    model = empty_model(folder)
else:
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, local_files_only=True).eval()
built = time.perf_counter() - start
ids = torch.randint(3, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(0))
quantizer = None
if mode:  # imported only here: the unquantized runs' import baseline must not count NNCF
    from hfexport.quantizers import NNCFOnnxQuantizer, NNCFOpenVINOQuantizer, NNCFWeightCompressionConfig
    compression = NNCFWeightCompressionConfig(mode=mode, group_size=None if mode.startswith("int8") else group)
    quantizer = (NNCFOpenVINOQuantizer if fmt == "openvino" else NNCFOnnxQuantizer)(compression)
if fmt == "openvino":
    config, exporter = OpenVINOConfig(dynamic=True, low_memory=low, quantizer=quantizer), OpenVINOExporter()
else:
    config, exporter = OnnxConfig(dynamic=True, low_memory=low, quantizer=quantizer), OnnxExporter()
with stage_listener(lambda name: stage.__setitem__(0, name)):
    program = exporter.export(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, config)
exported = time.perf_counter() - start
stage[0] = "save"
save(program, out, config=config, report=exporter.report)
done.set()
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"onnxruntime", "openvino", "onnx", "onnxscript", "onnx_ir",
               "transformers", "safetensors", "numpy", "sympy", "executorch", "optimum"})
if modules_out:  # the modules this export imported, for the import baseline (IMPORTS_CHILD)
    Path(modules_out).write_text("\n".join(sorted(m for m in sys.modules if not m.startswith("__"))))
print("RESULT " + json.dumps({"build_s": built, "export_s": exported - built, "total_s": time.perf_counter() - start,
      "stages": exporter.report.stage_seconds, "imports": imports, "hwm_gb": status("VmHWM"),
      "stage_peak_gb": {k: round(v, 3) for k, v in peaks.items()}, "modules": heavy}))
"""

# The import baseline: a process that imports every module an export imported (the list its child wrote) and
# does nothing else. Its peak is the part of an export's peak that no change to the export itself can remove.
IMPORTS_CHILD = r"""
import importlib, sys
for name in open(sys.argv[1]).read().split():
    try:
        importlib.import_module(name)
    except BaseException:  # a module that only imports in its package's context: its package imported it
        pass
hwm = [int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:")][0]
print("RESULT", hwm / 1e6)
"""


def import_baseline(modules: Path) -> float:
    """Peak RSS (GB) of a process that only imports the modules listed in `modules`."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    done = subprocess.run([sys.executable, "-c", IMPORTS_CHILD, str(modules)], capture_output=True, text=True, env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(f"the import baseline failed: {done.stderr.strip()[-500:]}")
    return float(lines[-1].split()[1])


def _rss_kb(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def run_child(
    folder: Path,
    out: Path,
    low: bool,
    limit_gb: float | None,
    fmt: str = "onnx",
    modules: Path | None = None,
    quantize: str | None = None,
    group_size: int = 32,
) -> dict[str, Any]:
    """Export in a child process (with NNCF weight compression in mode `quantize`, if set); its peak RSS (polled,
    and the child's own VmHWM), peak RSS per export stage, wall time, and whether it was killed over the limit.
    `modules`: where the child lists the modules it imported."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    start = time.perf_counter()
    quantizer = [quantize, str(group_size)] if quantize else []
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            CHILD,
            str(folder),
            str(out),
            "1" if low else "0",
            fmt,
            str(modules) if modules else "-",
            *quantizer,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    peak, killed = 0, False
    while child.poll() is None:
        peak = max(peak, _rss_kb(child.pid))
        if limit_gb is not None and peak > limit_gb * 1e6:
            child.kill()
            killed = True
            break
        time.sleep(0.02)
    stdout, stderr = child.communicate()
    result: dict[str, Any] = {"peak_rss_gb": peak / 1e6, "wall_s": time.perf_counter() - start, "killed": killed}
    for line in stdout.splitlines():
        if line.startswith("RESULT "):
            result.update(json.loads(line[len("RESULT ") :]))
    if child.returncode != 0 and not killed:
        result["error"] = stderr.strip().splitlines()[-1:] or [f"exit {child.returncode}"]
    return result


def check_weights(folder: Path, out: Path, fmt: str = "onnx", quantized: bool = False) -> dict[str, Any]:
    """The low-memory artifact's streamed weights against the checkpoint, one tensor at a time (quantized ones
    recomputed from it)."""
    from hfexport.artifacts.low_memory import check_streamed_ir, check_streamed_quantized, check_streamed_weights
    from hfexport.core.checkpoints import Checkpoint

    if fmt == "openvino":
        result = check_streamed_ir(out / "model.xml", Checkpoint.open(folder))
    else:
        result = check_streamed_weights(out / "model.onnx", Checkpoint.open(folder))
    checked = {"checked": len(result.checked), "mismatched": result.mismatched}
    if quantized and fmt == "onnx":
        result = check_streamed_quantized(out / "model.onnx", Checkpoint.open(folder))
        checked.update(quantized_checked=len(result.checked), quantized_mismatched=result.mismatched)
    return checked


def artifact_files(out: Path) -> dict[str, Any]:
    """Size and sha256 of each file of a saved artifact, as its manifest records them."""
    manifest = json.loads((out / "manifest.json").read_text())
    return {name: {"bytes": entry["size"], "sha256": entry["sha256"]} for name, entry in manifest["checksums"].items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="smollm2", help="layer width (default smollm2)")
    parser.add_argument("--target-gb", type=float, default=None, help="checkpoint size (default: 4 layers)")
    parser.add_argument("--limit-gb", type=float, default=None, help="kill an export whose RSS passes this")
    parser.add_argument("--only", choices=("low-memory", "in-memory"), help="run one path only")
    parser.add_argument("--work", type=Path, default=None, help="folder for the checkpoint and artifacts (kept)")
    parser.add_argument("--formats", default="onnx", help="comma-separated: onnx, openvino (default onnx)")
    parser.add_argument("--keep", action="store_true", help="keep the artifacts (and a temporary work folder)")
    parser.add_argument(
        "--quantize",
        choices=("int8_asym", "int8_sym", "int4_sym", "int4_asym"),
        help="NNCF data-free weight compression on both paths (NNCFOnnxQuantizer / NNCFOpenVINOQuantizer)",
    )
    parser.add_argument("--group-size", type=int, default=32, help="int4 group size (default 32; SmolLM2: 576)")
    args = parser.parse_args(argv)

    shape = dict(SHAPES[args.shape])
    shape["num_hidden_layers"] = layers_for(args.target_gb, shape) if args.target_gb else 4
    work = args.work or Path(tempfile.mkdtemp(prefix="hfexport-bench-lowmem-"))
    folder = work / "checkpoint"
    folder.mkdir(parents=True, exist_ok=True)
    if not (folder / "model.safetensors.index.json").is_file():
        size = write_checkpoint(folder, shape)
    else:
        size = json.loads((folder / "model.safetensors.index.json").read_text())["metadata"]["total_size"]
    shards = len(list(folder.glob("*.safetensors")))
    print(f"checkpoint: {size / 1e9:.2f} GB in {shards} shard(s), {shape['num_hidden_layers']} layers ({folder})")
    results: dict[str, Any] = {"checkpoint_gb": size / 1e9, "layers": shape["num_hidden_layers"]}
    if args.quantize:
        results["quantize"] = {"mode": args.quantize, "group_size": args.group_size}
    for fmt in args.formats.split(","):
        for name, low in (("low-memory", True), ("in-memory", False)):
            if args.only and args.only != name:
                continue
            out = work / f"{fmt}-{name}"
            modules = work / f"{fmt}-{name}.modules"
            result = run_child(folder, out, low, args.limit_gb, fmt, modules, args.quantize, args.group_size)
            if low and not result.get("error") and not result["killed"]:
                result["weights"] = check_weights(folder, out, fmt, quantized=bool(args.quantize))
            if not result.get("error") and not result["killed"]:
                result["files"] = artifact_files(out)  # both paths: equal sha256 is equal artifacts
            if modules.is_file():
                result["import_baseline_gb"] = import_baseline(modules)
            results[f"{fmt} {name}"] = result
            print(f"{fmt} {name}: {json.dumps(result)}", flush=True)
            if not args.keep:
                shutil.rmtree(out, ignore_errors=True)
        if f"{fmt} low-memory" in results and f"{fmt} in-memory" in results:
            low_run, full_run = results[f"{fmt} low-memory"], results[f"{fmt} in-memory"]
            low_rss = max(low_run["peak_rss_gb"], low_run.get("hwm_gb", 0.0))
            full_rss = max(full_run["peak_rss_gb"], full_run.get("hwm_gb", 0.0))
            # The baseline of the two: both import the same modules (the larger, to be fair to neither).
            base = max(low_run.get("import_baseline_gb", 0.0), full_run.get("import_baseline_gb", 0.0))
            results[f"{fmt} ratio"] = {
                "whole_process": low_rss / max(full_rss, 1e-9),
                "above_imports": (low_rss - base) / max(full_rss - base, 1e-9),
                "import_baseline_gb": base,
            }
            print(
                f"{fmt}: peak RSS low-memory {low_rss:.3f} GB / in-memory {full_rss:.3f} GB = "
                f"{low_rss / max(full_rss, 1e-9):.2f}; above the {base:.3f} GB import baseline: "
                f"{low_rss - base:.3f} / {full_rss - base:.3f} = {results[f'{fmt} ratio']['above_imports']:.2f}",
                flush=True,
            )
    if args.work is None and not args.keep:
        shutil.rmtree(work, ignore_errors=True)  # the checkpoint too (8 GB at --target-gb 8)
    return results


if __name__ == "__main__":
    main()
