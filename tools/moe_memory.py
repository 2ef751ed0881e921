"""Peak memory of one MoE experts prefill: transformers' `batched_mm` form against hfexport's routed form.

    python tools/moe_memory.py [--hidden 2048] [--experts 128] [--top-k 8] [--inter 768] [--tokens 512]

A Qwen3-MoE experts block (random bf16 weights, Qwen3-30B-A3B's width by default) runs one prefill of `--tokens`
tokens in a child process per form; the peak resident memory above the weights (`ru_maxrss` after the forward
minus the resident size before it) is what the forward allocated. `batched_mm` gathers every (token, slot)
pair's expert weights, which at 512 tokens is ~26 GB per projection: it runs at `--batched-tokens` (default 16)
and the figure is scaled to `--tokens` (its gathers grow linearly with tokens), printed as an estimate.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from typing import Any


def _experts(args: argparse.Namespace) -> Any:
    import torch
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(
        hidden_size=args.hidden,
        moe_intermediate_size=args.inter,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
    )
    torch.manual_seed(0)
    with torch.device("meta"):
        experts = Qwen3MoeExperts(config)
    experts = experts.to_empty(device="cpu").to(torch.bfloat16)
    for parameter in experts.parameters():
        parameter.data.normal_(0, 0.02)
    return experts.eval()


def child(form: str, tokens: int, args: argparse.Namespace) -> None:
    import torch
    from transformers.integrations import moe

    from hfexport.rewrites.experts import routed_experts_forward

    experts = _experts(args)
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(tokens, args.hidden, generator=generator).to(torch.bfloat16)
    logits = torch.randn(tokens, args.experts, generator=generator)
    weights, index = torch.topk(logits.softmax(-1), args.top_k, dim=-1)
    forward = moe.batched_mm_experts_forward if form == "batched_mm" else routed_experts_forward
    before = _rss_kb()
    with torch.no_grad():
        forward(experts, hidden, index, weights)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux
    print(json.dumps({"form": form, "tokens": tokens, "peak_above_weights_mb": (peak - before) / 1024}))


def _rss_kb() -> int:
    with open("/proc/self/statm") as f:
        import os

        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--batched-tokens", type=int, default=16)
    parser.add_argument("--child", nargs=2, metavar=("FORM", "TOKENS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], int(args.child[1]), args)
        return 0
    shape = [f"--{k}={getattr(args, k.replace('-', '_'))}" for k in ("hidden", "experts", "top-k", "inter")]
    rows = []
    for form, tokens in (("routed", args.tokens), ("batched_mm", args.batched_tokens)):
        out = subprocess.run(
            [sys.executable, __file__, *shape, "--child", form, str(tokens)], capture_output=True, text=True, check=True
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    routed, batched = rows
    estimate = batched["peak_above_weights_mb"] * args.tokens / args.batched_tokens
    print(
        f"experts {args.experts} top-{args.top_k}, hidden {args.hidden}, expert inter {args.inter}, bf16:\n"
        f"  routed (hfexport)  {args.tokens} tokens: {routed['peak_above_weights_mb']:.0f} MB above the weights\n"
        f"  batched_mm         {args.batched_tokens} tokens: {batched['peak_above_weights_mb']:.0f} MB "
        f"-> {args.tokens} tokens: ~{estimate / 1024:.1f} GB (scaled)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
