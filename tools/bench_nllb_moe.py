"""NLLB-MoE experts at a realistic width: time and peak memory of `patch/nllb-moe-routed-experts`' form.

    python tools/bench_nllb_moe.py [--tokens 512] [--experts 16] [--d-model 1024] [--ffn 4096] [--repeat 3]

One `NllbMoeExperts` layer (fp32, seed 0) fed by its `NllbMoeTop2Router` on `--tokens` random hidden states (no
capacity drop). Forms, each timed in this process (median of `--repeat` calls after one warm-up) with its peak
resident memory above the resident size before the call (VmHWM reset through /proc/self/clear_refs):

- `original`: transformers' forward (a loop over the experts hit, from `nonzero`: eager only, it does not export);
- `routed`: the rule's replacement, eager, and its torch.export program (`dynamo`), which is what hfexport exports;
- `every expert, every token`: what the rule's earlier dense form computed: each expert over
  all tokens, weighted and masked afterwards.

Max diff: against `original`. Expert FLOPs per form are printed too (rows an expert runs on x 2 matmuls).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench_moe import _hwm, _rss  # tools/ is on sys.path when this script runs


def measure(fn: Any, repeat: int) -> tuple[Any, float, float]:
    """fn's result, its median seconds over `repeat` calls after a warm-up, and the warm-up's peak MB above the
    resident size before it."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current resident size
    before = _rss()
    result = fn()
    peak = (_hwm() - before) / 2**20
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return result, statistics.median(times), peak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--d-model", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)

    import torch
    from transformers import NllbMoeConfig
    from transformers.models.nllb_moe.modeling_nllb_moe import NllbMoeExperts, NllbMoeTop2Router

    from hfexport.rewrites.engine import default_registry

    # The replacement `patch/nllb-moe-routed-experts` installs (it declines only training mode).
    routed_experts = default_registry().get("patch/nllb-moe-routed-experts").replacement

    config = NllbMoeConfig(
        d_model=args.d_model, num_experts=args.experts, expert_capacity=args.tokens, moe_token_dropout=0.2
    )
    torch.manual_seed(0)
    router = NllbMoeTop2Router(config).eval()
    experts = NllbMoeExperts(config, ffn_dim=args.ffn).eval()
    hidden = torch.randn(args.tokens, args.d_model)
    with torch.no_grad():
        router_mask, router_probs, _ = router(hidden)
    inputs = {"hidden_states": hidden, "router_mask": router_mask, "router_probs": router_probs}

    class Routed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.experts = experts

        def forward(self, hidden_states: Any, router_mask: Any, router_probs: Any) -> Any:
            return routed_experts(None, self.experts, hidden_states, router_mask, router_probs)

    def every_expert_every_token() -> Any:
        out = torch.zeros_like(hidden)
        for e in range(args.experts):
            weight = (router_probs * (router_mask == e).to(router_probs.dtype)).sum(-1, keepdim=True)
            out = out + experts[f"expert_{e}"](hidden) * weight
        return out

    routed_rows = sum(int((router_mask == e).any(-1).sum()) for e in range(args.experts))
    flops_per_row = 2 * 2 * args.d_model * args.ffn
    rows = []
    with torch.no_grad():
        start = time.perf_counter()
        routed = Routed()
        program = torch.export.export(routed, (), dict(inputs)).module()
        export_s = time.perf_counter() - start
        expected = experts(**inputs)  # also warms the original up, as the other forms are before their peak call
        forms = [
            ("original (eager)", lambda: experts(**inputs), None),
            ("routed (eager)", lambda: routed(**inputs), routed_rows),
            ("routed (dynamo program)", lambda: program(**inputs), routed_rows),
            ("every expert, every token (eager)", every_expert_every_token, args.experts * args.tokens),
        ]
        for name, fn, expert_rows in forms:
            result, seconds, peak = measure(fn, args.repeat)
            same = name.startswith(("original", "routed"))
            rows.append(
                {
                    "form": name,
                    "median_s": seconds,
                    "peak_mb": peak,
                    "expert_gflops": None if expert_rows is None else expert_rows * flops_per_row / 1e9,
                    "max_diff": (result - expected).abs().max().item() if same else None,
                }
            )
            print(json.dumps(rows[-1]), flush=True)

    weights_mb = sum(p.numel() * p.element_size() for p in experts.parameters()) / 2**20
    print()
    print(
        f"NllbMoeExperts: {args.experts} experts, d_model {args.d_model}, ffn {args.ffn} ({weights_mb:.0f} MB of "
        f"expert weights); {args.tokens} tokens, {routed_rows} routed (token, expert) rows; torch threads "
        f"{torch.get_num_threads()}; load {os.getloadavg()[0]:.1f}; routed export {export_s:.1f} s"
    )
    print("| form | median s | peak MB | expert GFLOPs | max diff vs original |")
    print("|---|---|---|---|---|")
    for row in rows:
        flops = "" if row["expert_gflops"] is None else f"{row['expert_gflops']:.1f}"
        diff = "" if row["max_diff"] is None else f"{row['max_diff']:.1e}"
        print(f"| {row['form']} | {row['median_s']:.3f} | {row['peak_mb']:.0f} | {flops} | {diff} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
