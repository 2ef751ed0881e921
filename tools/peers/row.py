"""One step of one row of tools/bench_peers.py, in the process (and the virtual environment) the row runs in.

    python tools/peers/row.py model  --shape S --layers N --out FOLDER          (the random model folder)
    python tools/peers/row.py build  --row ROW --model FOLDER --out ARTIFACT --max-length L
    python tools/peers/row.py run    --row ROW --model FOLDER --out ARTIFACT --prompt FILE --new N
    python tools/peers/row.py ceiling [--megabytes M]                          (matvec bandwidth, weights per token)

Each step prints its result as one line `RESULT {json}` last. Standard library at the top: what a row needs is
imported in its own functions, so this file runs under the peers' environments (onnxruntime-genai, optimum-intel,
optimum-executorch), which hfexport is not installed in, and under the project's for eager and hfexport rows.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/: bench_onnx (standard library at import)
from bench_onnx import SMOLLM2_135M

# Shapes of the benchmark's models, written out (nothing is downloaded): SmolLM2-135M's Llama (the shape of
# tools/bench_onnx.py and tools/bench_generate.py) and Qwen2.5-0.5B's.
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": {"model_type": "llama", **SMOLLM2_135M},
    "qwen2.5-0.5b": {
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "tie_word_embeddings": True,
        "hidden_act": "silu",
        "use_sliding_window": False,
    },
}
# hfexport rows: the backend name of `hfexport.apps.bench` (its recipes, `quantizer_for`) for each row family.
HFEXPORT_BACKENDS = {
    "hfexport-onnx": "onnx",
    "hfexport-openvino": "openvino-stateful",
    "hfexport-executorch": "executorch",
}
# The int4 recipe of the OpenVINO rows, ours and optimum-intel's
# (`hfexport.apps.bench.quantizer_for("openvino", "int4")`).
OV_INT4 = {"bits": 4, "sym": True, "group_size": 32, "ratio": 1.0, "all_layers": True}


def result(value: dict[str, Any]) -> None:
    print("RESULT " + json.dumps(value), flush=True)


# -- the model folder -------------------------------------------------------------------------------------------


def build_model_folder(shape: str, layers: int | None, out: Path) -> dict[str, Any]:
    """A random model of `shape` (seed 0) saved as a Hugging Face folder with a word-level tokenizer of its vocabulary
    (the peers' builders read a tokenizer; the benchmark feeds token ids)."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig, PreTrainedTokenizerFast

    settings = dict(SHAPES[shape])
    if layers is not None:
        settings["num_hidden_layers"] = layers
    config = AutoConfig.for_model(settings.pop("model_type"), **settings, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model.save_pretrained(out)
    # The special tokens hold ids 0-2 alone: a vocabulary where "t0".."t2" shared them made the saved tokenizer add
    # "</s>" again past the vocabulary, and onnxruntime-genai's builder then wrote that id (49153) as an EOS id its
    # generator refuses.
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, config.vocab_size)}}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<unk>",
    )
    tokenizer.save_pretrained(out)
    return {"parameters": sum(p.numel() for p in model.parameters()), "layers": config.num_hidden_layers}


# -- builds -----------------------------------------------------------------------------------------------------


def build(row: str, precision: str, model: Path, out: Path, max_length: int) -> None:
    """Export `model` as `row` does at `precision` into `out` (the benchmark times this whole process)."""
    if row in HFEXPORT_BACKENDS:
        _build_hfexport(HFEXPORT_BACKENDS[row], precision, model, out, max_length)
    elif row == "onnxruntime-genai":
        # Its own command line, in this process: `python -m onnxruntime_genai.models.builder`.
        sys.argv = ["builder", "-i", str(model), "-o", str(out), "-p", precision, "-e", "cpu"]
        import runpy

        runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__")
    elif row == "optimum-intel":
        from optimum.intel import OVModelForCausalLM, OVWeightQuantizationConfig

        quantization = OVWeightQuantizationConfig(**OV_INT4) if precision == "int4" else None
        exported = OVModelForCausalLM.from_pretrained(
            model, export=True, load_in_8bit=False, quantization_config=quantization, compile=False
        )
        exported.save_pretrained(out)
    elif row == "optimum-executorch":
        command = [
            str(Path(sys.executable).with_name("optimum-cli")),
            *("export", "executorch", "--model", str(model), "--task", "text-generation", "--recipe", "xnnpack"),
            *("--use_custom_sdpa", "--use_custom_kv_cache", "--max_seq_len", str(max_length), "--output_dir", str(out)),
        ]
        if precision == "8da4w":
            command += ["--qlinear", "8da4w"]
        subprocess.run(command, check=True)
    else:
        raise SystemExit(f"unknown row {row!r}")


def _build_hfexport(backend: str, precision: str, model_dir: Path, out: Path, max_length: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from hfexport.apps.bench import generation_cache, generation_export
    from hfexport.artifacts import save
    from hfexport.auto import AutoHfExporter

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.randint(3, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    sample = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    config, configs, call_sample, multi_token = generation_export(backend, precision, sample)
    components = AutoHfExporter.from_config(config).export_for_generation(
        model,
        call_sample,
        configs,
        generation_config=generation_cache(backend, max_length),
        multi_token_decode=multi_token,
    )
    save(components, out, config=config, model=model)


# -- generation -------------------------------------------------------------------------------------------------


def generator(
    row: str, precision: str, model_dir: Path, artifact: Path, prompt: list[int]
) -> Callable[[int], list[int]]:
    """`generate(n)`: the `n` greedy tokens after `prompt` by the row's own generation loop (batch 1)."""
    if row == "eager":
        return _eager(model_dir, prompt)
    if row in HFEXPORT_BACKENDS:
        return _hfexport(artifact, prompt)
    if row == "onnxruntime-genai":
        return _genai(artifact, prompt)
    if row == "optimum-intel":
        return _optimum_intel(artifact, prompt, precision)
    if row == "optimum-executorch":
        return _optimum_executorch(artifact, prompt)
    raise SystemExit(f"unknown row {row!r}")


def _eager(model_dir: Path, prompt: list[int]) -> Callable[[int], list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    ids = torch.tensor([prompt])

    def generate(n: int) -> list[int]:
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        return out[0, len(prompt) :].tolist()

    return generate


def _hfexport(artifact: Path, prompt: list[int]) -> Callable[[int], list[int]]:
    import torch

    from hfexport.artifacts import load
    from hfexport.runtime.generation import generate as run

    loaded = load(artifact)
    ids = torch.tensor([prompt])

    def generate(n: int) -> list[int]:
        out = run(loaded, ids, torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n)
        return out[0, len(prompt) :].tolist()

    return generate


def _genai(artifact: Path, prompt: list[int]) -> Callable[[int], list[int]]:
    import onnxruntime_genai as og

    model = og.Model(str(artifact))

    def generate(n: int) -> list[int]:
        params = og.GeneratorParams(model)
        total = len(prompt) + n
        params.set_search_options(max_length=total, min_length=total, do_sample=False)
        loop = og.Generator(model, params)
        loop.append_tokens(prompt)
        while not loop.is_done():
            loop.generate_next_token()
        return list(loop.get_sequence(0))[len(prompt) :]

    return generate


def _optimum_intel(artifact: Path, prompt: list[int], precision: str) -> Callable[[int], list[int]]:
    import torch
    from optimum.intel import OVModelForCausalLM

    # fp32 and int4: activations in f32 as ours run; "default": the device's default precision (bf16 where the CPU
    # has it), the precision optimum-intel runs when not told.
    ov_config = {} if precision == "default" else {"INFERENCE_PRECISION_HINT": "f32"}
    model = OVModelForCausalLM.from_pretrained(artifact, ov_config=ov_config)
    ids = torch.tensor([prompt])

    def generate(n: int) -> list[int]:
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n, do_sample=False
        )
        return out[0, len(prompt) :].tolist()

    return generate


def _optimum_executorch(artifact: Path, prompt: list[int]) -> Callable[[int], list[int]]:
    from optimum.executorch import ExecuTorchModelForCausalLM

    model = ExecuTorchModelForCausalLM.from_pretrained(artifact)
    model.eos_token_ids = set()  # its loop stops at EOS; the benchmark generates a fixed count, as min_new_tokens does

    def generate(n: int) -> list[int]:
        return list(model.generate(prompt_tokens=list(prompt), max_seq_len=len(prompt) + n))

    return generate


def run(row: str, precision: str, model_dir: Path, artifact: Path, prompt: list[int], new: int) -> dict[str, Any]:
    """One round of a row: load, warm up, then a 1-token call (TTFT) and a `new`-token call."""
    start = time.perf_counter()
    generate = generator(row, precision, model_dir, artifact, prompt)
    load_s = time.perf_counter() - start
    generate(2)  # sessions, allocations, first-call compilation
    start = time.perf_counter()
    generate(1)
    ttft = time.perf_counter() - start
    start = time.perf_counter()
    tokens = generate(new)
    whole = time.perf_counter() - start
    return {"ttft_s": ttft, "decode_s": whole - ttft, "load_s": load_s, "tokens": [int(t) for t in tokens]}


def ceiling(megabytes: int) -> dict[str, Any]:
    from hfexport.apps.bench import matvec_bandwidth

    return {"bandwidth": matvec_bandwidth(megabytes, 10 if megabytes >= 256 else 3)}


def weights_per_token(model_dir: Path) -> int:
    from transformers import AutoModelForCausalLM

    from hfexport.apps.bench import weight_bytes_per_token

    return weight_bytes_per_token(AutoModelForCausalLM.from_pretrained(model_dir))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=("model", "build", "run", "ceiling"))
    parser.add_argument("--shape", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int)
    parser.add_argument("--row")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--model", type=Path)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--max-length", type=int, default=192)
    parser.add_argument("--prompt", type=Path, help="a JSON list of token ids")
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--megabytes", type=int, default=512)
    args = parser.parse_args(argv)
    if args.step == "model":
        info = build_model_folder(args.shape, args.layers, args.out)
        result({**info, "weight_bytes_per_token": weights_per_token(args.out)})
    elif args.step == "build":
        if args.out.exists():
            shutil.rmtree(args.out)
        build(args.row, args.precision, args.model, args.out, args.max_length)
        result({"built": str(args.out)})
    elif args.step == "run":
        prompt = json.loads(args.prompt.read_text())
        result(run(args.row, args.precision, args.model, args.out, prompt, args.new))
    else:
        result(ceiling(args.megabytes))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
