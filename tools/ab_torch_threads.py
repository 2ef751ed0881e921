"""A/B of `generate(..., torch_threads=...)`: generation with torch's own thread count kept vs set to 1 while a runtime
with threads of its own (ONNX Runtime, OpenVINO, ExecuTorch) runs the components.

    python tools/ab_torch_threads.py [--layers 8] [--backends onnx,openvino-stateful,executorch] [--rounds 4]
        [--prompt 128] [--new 64] [--precision fp32]

Each backend is exported once (`tools/profile_generate.export_like_bench`: the benchmark's SmolLM2-shaped Llama cut
to `--layers`, static cache of prompt + new slots, one multi-token decode graph); then rounds alternate the two
settings (A: `torch_threads=None`, torch's count as it is; B: the default, 1), each round a 1-token generate (TTFT)
and a `--new`-token one; decode tok/s = (new - 1) / (time(new) - TTFT). The medians, their ratio, and whether
both settings give the same tokens. Alternating rounds in one process puts a change of machine load on both sides.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from profile_generate import export_like_bench  # tools/ is on sys.path when this script runs

from hfexport.apps.bench import timed_alternately
from hfexport.runtime.generation import generate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--backends", default="onnx,openvino-stateful,executorch")
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new", type=int, default=64)
    args = parser.parse_args(argv)

    import torch

    settings = {"A keep": None, "B one": 1}
    lines = []
    load_start = os.getloadavg()[0]
    for backend in args.backends.split(","):
        _, ids, _, components, export_s, _ = export_like_bench(
            backend, args.precision, args.layers, args.prompt, args.prompt + args.new
        )
        mask = ids.new_ones(ids.shape)
        print(f"{backend}: exported in {export_s:.0f} s", flush=True)

        def run(threads: int | None, feed: tuple[Any, ...] = (components, ids, mask)) -> Any:
            return lambda n: generate(*feed, max_new_tokens=n, min_new_tokens=n, torch_threads=threads)

        timed = timed_alternately({name: run(threads) for name, threads in settings.items()}, args.new, args.rounds)
        a, b = (timed[name].tokens_per_s for name in settings)
        ta, tb = (timed[name].ttft_s for name in settings)
        same = torch.equal(*(timed[name].output for name in settings))
        lines.append(
            f"| {backend} | {args.precision} | {ta * 1e3:.0f} / {tb * 1e3:.0f} | {a:.1f} / {b:.1f} | {b / a:.2f} | "
            f"{'equal' if same else 'differ'} |"
        )
        print(lines[-1], flush=True)
    print()
    print(
        f"{args.layers} layers, prompt {args.prompt}, {args.new} new tokens, {args.rounds} rounds; torch threads "
        f"{torch.get_num_threads()}; load {load_start:.1f} -> {os.getloadavg()[0]:.1f}"
    )
    print("| backend | precision | TTFT ms A / B | decode tok/s A / B | B / A | tokens |")
    print("|---|---|---|---|---|---|")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
