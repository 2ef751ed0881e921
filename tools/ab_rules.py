"""What each speed rule gains: generation with every rule against generation with one optimization rule switched off.

    python tools/ab_rules.py [--backend onnx] [--model llama] [--layers 8] [--rounds 4] [--prompt 128] [--new 64]
        [--precision fp32] [--rules onnx/rms-norm-fusion,...] [--json out.json]

The model is the benchmark's SmolLM2-135M-shaped Llama (`--model llama`), a GPT-2 of the same width (`--model
gpt2`: LayerNorm, tanh GELU and biased projections, which the Llama does not have) or another causal LM's
`model_type` at that width (`--model nanochat`: RMSNorms without a weight), cut to `--layers`, random weights (seed
0). It is exported once with every rule (`export_for_generation`, static cache of prompt + new slots,
one multi-token decode graph, `hfexport.apps.bench.quantizer_for`'s recipe, as `hfexport bench` does); the export's
reports say which `kind="optimization"` rules fired (or `--rules` names them), and it is exported again once per
such rule with that rule disabled. Rounds then alternate every export, each round a 1-token generate (TTFT) and a
`--new`-token one; decode tok/s = (new - 1) / (time(new) - TTFT). Alternating rounds in one process puts a change of
machine load on every side. Prints, per rule: its hits, the medians with and without it, their ratio, and whether
the tokens are equal. A rule another rule requires is disabled with it (the engine's order), so its row measures
both.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any

from bench_onnx import SMOLLM2_135M  # tools/ is on sys.path when this script runs

from hfexport.apps.bench import VARIANTS, timed_alternately
from hfexport.runtime.generation import generate


def build(model: str, layers: int) -> Any:
    """`model` at SmolLM2-135M's width, `layers` deep, random weights (seed 0): "llama" is the benchmark's model,
    "gpt2" a GPT-2 of that width (GPT2Config names its sizes its own way), any other transformers `model_type`
    takes SmolLM2's sizes by their common names (`AutoConfig.for_model`)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config

    torch.manual_seed(0)
    if model == "gpt2":
        width = SMOLLM2_135M
        config = GPT2Config(
            vocab_size=width["vocab_size"],
            n_embd=width["hidden_size"],
            n_head=width["num_attention_heads"],
            n_inner=width["intermediate_size"],
            n_layer=layers,
            n_positions=1024,
        )
    else:
        config = AutoConfig.for_model(model, **{**SMOLLM2_135M, "num_hidden_layers": layers})
    config._attn_implementation = "sdpa"
    return AutoModelForCausalLM.from_config(config).eval()


def export(model: Any, backend: str, precision: str, cache: int, disable: tuple[str, ...] = ()) -> tuple[Any, Any]:
    """`export_for_generation` as the benchmark runs it (`hfexport.apps.bench.generation_export`: one config, or one per
    component for the static-decode variant), with `disable` switched off: the components and each component's
    report (one per exported graph)."""
    import torch
    from transformers import GenerationConfig

    from hfexport.apps.bench import generation_export
    from hfexport.auto import AutoHfExporter

    ids = torch.randint(3, model.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(2))
    sample = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    config, configs, sample, multi_token = generation_export(backend, precision, sample)
    if disable:

        def without(c: Any) -> Any:
            return dataclasses.replace(c, rules=c.rules.with_disabled(disable, "A/B"))

        config = without(config)
        configs = {name: without(c) for name, c in configs.items()} if isinstance(configs, dict) else config
    exporter = AutoHfExporter.from_config(config)
    components = exporter.export_for_generation(
        model,
        sample,
        configs,
        generation_config=GenerationConfig(cache_implementation="static", max_cache_len=cache),
        multi_token_decode=multi_token,
    )
    from hfexport.exporters.generation import SHARED_PREFILL_NOTE

    # A graph shared by prefill and decode has a copy of its report under each role: count it once.
    return components, [r for r in exporter.reports.values() if SHARED_PREFILL_NOTE not in r.notes]


def fired_optimizations(reports: list[Any]) -> dict[str, int]:
    """The optimization rules that fired, with their hits summed over the components' reports."""
    hits: dict[str, int] = {}
    for report in reports:
        for outcome in report.rules:
            if outcome.kind == "optimization" and outcome.hits:
                hits[outcome.id] = hits.get(outcome.id, 0) + outcome.hits
    return hits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="onnx", choices=sorted({"onnx", "executorch", "openvino", *VARIANTS}))
    parser.add_argument("--model", default="llama", help="llama (the benchmark's), gpt2, or a model_type")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "int8", "int4"))
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--rules", default="", help="rule ids to switch off one at a time (default: those that fired)")
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)

    import torch

    load_start = os.getloadavg()[0]
    model = build(args.model, args.layers)
    cache = args.prompt + args.new
    start = time.perf_counter()
    components, reports = export(model, args.backend, args.precision, cache)
    print(f"every rule: exported in {time.perf_counter() - start:.0f} s", flush=True)
    hits = fired_optimizations(reports)
    rules = [r for r in args.rules.split(",") if r] or sorted(hits)
    variants: dict[str, Any] = {"every rule": components}
    for rule in rules:
        start = time.perf_counter()
        variants[rule], without = export(model, args.backend, args.precision, cache, (rule,))
        now = fired_optimizations(without)
        left = {r: now.get(r, 0) for r in {*hits, *now} - {rule} if hits.get(r, 0) != now.get(r, 0)}
        seconds = time.perf_counter() - start
        print(f"without {rule}: exported in {seconds:.0f} s; other rules' hits changed: {left}", flush=True)

    ids = torch.randint(3, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)

    def run(components: Any) -> Any:
        return lambda n: generate(components, ids, mask, max_new_tokens=n, min_new_tokens=n)

    timed = timed_alternately({name: run(comps) for name, comps in variants.items()}, args.new, args.rounds)
    base = timed["every rule"]
    rows = [
        {
            "rule": rule,
            "hits": hits.get(rule, 0),
            "tok_s_with": round(base.tokens_per_s, 1),
            "tok_s_without": round(timed[rule].tokens_per_s, 1),
            "decode_gain": round(base.tokens_per_s / timed[rule].tokens_per_s, 3),
            "ttft_ms_with": round(base.ttft_s * 1e3),
            "ttft_ms_without": round(timed[rule].ttft_s * 1e3),
            "tokens_equal": bool(torch.equal(timed[rule].output, base.output)),
        }
        for rule in rules
    ]
    summary = (
        f"{args.backend} {args.precision}, {args.model} at {args.layers} layers, prompt {args.prompt}, {args.new} new "
        f"tokens, {args.rounds} rounds; torch threads {torch.get_num_threads()}; load {load_start:.1f} -> "
        f"{os.getloadavg()[0]:.1f}"
    )
    print()
    print(summary)
    print("| rule | hits | decode tok/s with / without | gain | TTFT ms with / without | tokens |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['rule']} | {row['hits']} | {row['tok_s_with']} / {row['tok_s_without']} | "
            f"{row['decode_gain']:.2f}x | {row['ttft_ms_with']} / {row['ttft_ms_without']} | "
            f"{'equal' if row['tokens_equal'] else 'differ'} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
