"""Gated delta rule for the ONNX backend: the `scan` of `patch/gated-delta-chunk-scan-hop`, its inputs detached.

Without a rule, torch.onnx captures transformers' unrolled chunk loop and ONNX Runtime fails past the sample's
chunk count (qwen3_5_moe_text exported from its 8-token sample: 'BroadcastIterator::Append axis == 1 || axis ==
largest' in a Mul on 73 and 138 tokens). The Dynamo rule's scan fails in torch.onnx's type-promotion pass, as
Mamba-1's and Kimi delta attention's did (patch/mamba-selective-scan-onnx, patch/kimi-delta-chunk-scan-onnx); with
the scan's inputs detached, torch.onnx writes an ONNX `Scan` loop.
"""

from __future__ import annotations

from typing import Any

from hfexport.rewrites.example_models import token_inputs
from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.patch import ModuleFunctionPatch
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.patch.gated_delta_chunk_scan_hop import (
    FAMILIES,
    qwen3_next_example,
    scan_chunk_gated_delta_rule,
)


def scan_chunk_gated_delta_rule_onnx(original: Any, *args: Any, **kwargs: Any) -> Any:
    return scan_chunk_gated_delta_rule(original, *args, detach_scan_inputs=True, **kwargs)


gated_delta_chunk_scan_onnx = ModuleFunctionPatch(
    RuleMeta(
        id="patch/gated-delta-chunk-scan-onnx",
        why="the same cause as patch/gated-delta-chunk-scan-hop on ONNX: without a rule the program keeps the "
        "sample's chunk count and ONNX Runtime fails past 64 tokens (qwen3_5_moe_text from 8 tokens, 73 tokens: "
        "'BroadcastIterator::Append axis == 1 || axis == largest' in a Mul); the Dynamo rule's scan fails in "
        "torch.onnx's fake re-run of the program with grad enabled, so the scan's inputs are detached",
        upstream="transformers==5.24.0 models/qwen3_next/modeling_qwen3_next.py torch_chunk_gated_delta_rule (and its "
        "copies); torch.onnx type promotion running `scan`'s autograd path on fake tensors",
        backends=("onnx",),
        models=FAMILIES,
        examples=(
            Match(
                lambda: qwen3_next_example(8),
                "qwen3_next from 8 tokens (one chunk), then 2*64+3 tokens and another batch",
                other_inputs=lambda: token_inputs(3, 2 * 64 + 3),
            ),
            NoMatch(
                lambda: qwen3_next_example(8),
                "qwen3_next exported for 8 tokens only (static)",
                reason="the replacement declines a concrete sequence length: the original's unrolled loop is exact",
                slow=True,  # 46 s on the 2-core CI machine
            ),
        ),
    ),
    target=tuple(f"transformers.models.{f}.modeling_{f}.torch_chunk_gated_delta_rule" for f in FAMILIES),
    replacement=scan_chunk_gated_delta_rule_onnx,
)
