"""One peer recipe on the code model, run in the peer's own virtual environment (tools/peer_accuracy.py drives it).

    /work/peers/<peer>/bin/python tools/peers/run_peer.py --peer onnxruntime-genai --recipe int4 --model DIR \
        --inputs inputs.npz --work DIR --out result.npz

Standalone (numpy, torch and the peer's packages only; never hfexport): builds the peer's quantized model from the
float model folder, then writes to `--out` the logits of every evaluation window (`windows` of `--inputs`, each
run from an empty cache), `new` greedy tokens after each of `prompts` (argmax at every step, end of sequence
ignored) and the decode speed of the peer's own generation loop on `speed_prompt` (batch 1): the time of one new
token and of `speed_new`, three times each, from which the driver takes decode tokens/s = (new - 1) / (t(new) -
t(1)), the median.

Recipes:
- onnxruntime-genai (its model builder, `-e cpu`): int4 and int8 (weight-only MatMulNBits, blocks of 32,
  symmetric; its CPU default `accuracy_level=4` quantizes the activations to int8 in the matmul), and the same
  with `-acc1` (accuracy_level=1: float activations).
- optimum-intel (`OVModelForCausalLM` with `OVWeightQuantizationConfig`): int8 (per channel, asymmetric), int4
  (its defaults: asymmetric, groups of 128), int4-sym-g32, int4-awq-se (AWQ and scale estimation on
  `calibration` texts), each with the runtime's default inference precision (bf16 on a CPU with AMX/AVX-512 bf16)
  and, `-f32`, with `INFERENCE_PRECISION_HINT=f32`.
- optimum-executorch (`ExecuTorchModelForCausalLM`, XNNPACK): 8da4w (int8 dynamic activations, int4 weights in
  groups of 32, custom SDPA and KV cache).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch


def timed_generation(generate: Any, prompt: np.ndarray, new: int) -> dict[str, list[float]]:
    """Seconds of `generate(prompt, 1)` and `generate(prompt, new)`, three times each, alternated."""
    generate(prompt, 2)  # warm-up: sessions, compiled kernels
    first, full = [], []
    for _ in range(3):
        start = time.perf_counter()
        generate(prompt, 1)
        first.append(time.perf_counter() - start)
        start = time.perf_counter()
        generate(prompt, new)
        full.append(time.perf_counter() - start)
    return {"first": first, "full": full}


def greedy_by_recompute(logits_of: Any, prompts: np.ndarray, new: int) -> np.ndarray:
    """`new` argmax tokens after each prompt, the whole sequence run again at every step (no cache)."""
    rows = []
    for prompt in prompts:
        sequence = list(prompt)
        for _ in range(new):
            sequence.append(int(np.argmax(logits_of(np.array(sequence))[-1])))
        rows.append(sequence[len(prompt) :])
    return np.array(rows)


class OrtGenAI:
    def __init__(self, recipe: str, model: Path, work: Path) -> None:
        import onnxruntime

        precision, _, level = recipe.partition("-")
        out = work / f"onnxruntime-genai-{recipe}"
        command = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(model), "-o", str(out)]
        command += ["-p", precision, "-e", "cpu", "-c", str(work / "cache")]
        if level:
            command += ["--extra_options", f"accuracy_level={level.removeprefix('acc')}"]
        subprocess.run(command, check=True, capture_output=True)
        self.folder = out
        self.session = onnxruntime.InferenceSession(str(out / "model.onnx"), providers=["CPUExecutionProvider"])
        self.past = [i for i in self.session.get_inputs() if i.name.startswith("past_key_values")]
        decoder = json.loads((out / "genai_config.json").read_text())["model"]["decoder"]
        self.kv_shape = (1, decoder["num_key_value_heads"], 0, decoder["head_size"])  # an empty cache

    def logits(self, ids: np.ndarray) -> np.ndarray:
        feed = {"input_ids": ids[None].astype(np.int64), "attention_mask": np.ones((1, len(ids)), np.int64)}
        for value in self.past:
            feed[value.name] = np.zeros(self.kv_shape, np.float32)
        return self.session.run(["logits"], feed)[0][0]

    def generate(self, prompt: np.ndarray, new: int) -> list[int]:
        import onnxruntime_genai as og

        if not hasattr(self, "og_model"):
            self.og_model = og.Model(str(self.folder))
        params = og.GeneratorParams(self.og_model)
        params.set_search_options(do_sample=False, max_length=len(prompt) + new, min_length=len(prompt) + new)
        generator = og.Generator(self.og_model, params)
        generator.append_tokens(prompt.astype(np.int32).tolist())
        tokens = []
        while not generator.is_done() and len(tokens) < new:
            generator.generate_next_token()
            tokens.append(int(generator.get_next_tokens()[0]))
        return tokens


class OptimumIntel:
    def __init__(self, recipe: str, model: Path, work: Path, calibration: list[str]) -> None:
        from optimum.intel import OVModelForCausalLM, OVWeightQuantizationConfig

        base = recipe.removesuffix("-f32")
        options: dict[str, Any] = {
            "int8": {"bits": 8},
            "int4": {"bits": 4},
            "int4-sym-g32": {"bits": 4, "sym": True, "group_size": 32},
            "int4-awq-se": {
                "bits": 4,
                "sym": True,
                "group_size": 32,
                "quant_method": "awq",
                "scale_estimation": True,
                "dataset": calibration,
                "tokenizer": str(model),
                "num_samples": len(calibration),
            },
        }[base]
        ov_config = {"INFERENCE_PRECISION_HINT": "f32"} if recipe.endswith("-f32") else None
        self.model = OVModelForCausalLM.from_pretrained(
            str(model), export=True, quantization_config=OVWeightQuantizationConfig(**options), ov_config=ov_config
        )

    def logits(self, ids: np.ndarray) -> np.ndarray:
        tensor = torch.from_numpy(ids.astype(np.int64))[None]
        with torch.no_grad():
            return self.model(input_ids=tensor, attention_mask=torch.ones_like(tensor)).logits[0].float().numpy()

    def generate(self, prompt: np.ndarray, new: int) -> list[int]:
        tensor = torch.from_numpy(prompt.astype(np.int64))[None]
        out = self.model.generate(
            input_ids=tensor,
            attention_mask=torch.ones_like(tensor),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
        )
        return out[0, len(prompt) :].tolist()


class OptimumExecutorch:
    def __init__(self, recipe: str, model: Path, work: Path) -> None:
        from optimum.executorch import ExecuTorchModelForCausalLM

        assert recipe == "8da4w", recipe
        self.model = ExecuTorchModelForCausalLM.from_pretrained(
            str(model),
            task="text-generation",  # without it, a local folder is looked up on the Hub for its task
            recipe="xnnpack",
            attn_implementation="custom_sdpa",
            use_custom_kv_cache=True,
            qlinear="8da4w",
            max_seq_len=512,
        )

    def _forward(self, ids: list[int], start: int) -> np.ndarray:
        tokens = torch.tensor([ids], dtype=torch.long)
        positions = torch.arange(start, start + len(ids), dtype=torch.long)
        return self.model.forward(input_ids=tokens, cache_position=positions).float().numpy()

    def logits(self, ids: np.ndarray) -> np.ndarray:
        # One token at a time through the static cache, from position 0 (what the prefill graph returns is the
        # last position's logits only).
        return np.stack([self._forward([int(token)], i).reshape(-1) for i, token in enumerate(ids)])

    def generate(self, prompt: np.ndarray, new: int) -> list[int]:
        logits = self._forward([int(t) for t in prompt], 0)
        token = int(np.argmax(logits.reshape(-1, logits.shape[-1])[-1]))
        tokens = [token]
        while len(tokens) < new:
            token = int(np.argmax(self._forward([token], len(prompt) + len(tokens) - 1).reshape(-1)))
            tokens.append(token)
        return tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peer", required=True, choices=("onnxruntime-genai", "optimum-intel", "optimum-executorch"))
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--inputs", type=Path, required=True)
    parser.add_argument("--work", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    data = np.load(args.inputs)
    calibration = json.loads(str(data["calibration"]))
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if args.peer == "onnxruntime-genai":
        peer: Any = OrtGenAI(args.recipe, args.model, args.work)
    elif args.peer == "optimum-intel":
        peer = OptimumIntel(args.recipe, args.model, args.work, calibration)
    else:
        peer = OptimumExecutorch(args.recipe, args.model, args.work)
    export_seconds = time.perf_counter() - started
    logits = np.stack([peer.logits(window) for window in data["windows"]]).astype(np.float32)
    new = int(data["new"])
    if isinstance(peer, OptimumExecutorch):
        greedy = np.array([peer.generate(prompt, new) for prompt in data["prompts"]])
    else:
        greedy = greedy_by_recompute(peer.logits, data["prompts"], new)
    timings = timed_generation(peer.generate, data["speed_prompt"], int(data["speed_new"]))
    np.savez(
        args.out,
        logits=logits,
        greedy=greedy,
        first=np.array(timings["first"]),
        full=np.array(timings["full"]),
        export_seconds=export_seconds,
    )
    tokens = statistics.median(timings["full"]), statistics.median(timings["first"])
    print(f"{args.peer} {args.recipe}: exported in {export_seconds:.0f}s; generation {tokens}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
