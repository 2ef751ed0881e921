"""Kimi delta attention for the ONNX backend: the `scan` of `patch/kimi-delta-chunk-scan-hop`, its inputs detached.

Without a rule, torch.onnx captures transformers' unrolled chunk loop and ONNX Runtime fails past the sample's
chunk count (bailing_hybrid and kimi_linear exported from 8 tokens: 'Non-zero status code returned while running
Slice node' on 73 and 138 tokens). The Dynamo rule's scan fails in torch.onnx's type-promotion pass, as Mamba-1's
did (see patch/mamba-selective-scan-onnx); with the scan's inputs detached, torch.onnx writes an ONNX `Scan` loop.
"""

from __future__ import annotations

from typing import Any

from hfexport.rewrites.example_models import token_inputs
from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.patch import ModuleFunctionPatch
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.patch.kimi_delta_chunk_scan_hop import (
    FAMILIES,
    bailing_hybrid_example,
    chunk_scan,
    kimi_linear_example,
)


def scan_chunk_kimi_delta_attention_onnx(original: Any, *args: Any, **kwargs: Any) -> Any:
    return chunk_scan(*args, detach_scan_inputs=True, **kwargs)


kimi_delta_chunk_scan_onnx = ModuleFunctionPatch(
    RuleMeta(
        id="patch/kimi-delta-chunk-scan-onnx",
        why="the same cause as patch/kimi-delta-chunk-scan-hop on ONNX: without a rule the program keeps the "
        "sample's chunk count and ONNX Runtime fails past 64 tokens (bailing_hybrid and kimi_linear from 8 tokens, "
        "73 tokens: 'Non-zero status code returned while running Slice node'); the Dynamo rule's scan fails in "
        "torch.onnx's fake re-run of the program with grad enabled, so the scan's inputs are detached",
        upstream="transformers==5.24.0 models/kimi_linear/modeling_kimi_linear.py chunk_kimi_delta_attention (and its "
        "copies); torch.onnx type promotion running `scan`'s autograd path on fake tensors",
        backends=("onnx",),
        models=FAMILIES,
        examples=(
            Match(
                lambda: bailing_hybrid_example(8),
                "bailing_hybrid from 8 tokens (one chunk), then 73 tokens and another batch",
                other_inputs=lambda: token_inputs(3, 73),
            ),
            Match(
                lambda: kimi_linear_example(8),
                "kimi_linear from 8 tokens, then exactly two chunks plus ten (138 tokens)",
                other_inputs=lambda: token_inputs(1, 138),
            ),
            # First (the default tier's NoMatch): the static-length one below exports the unrolled loops to ONNX
            # twice, about 50 s on 2 cores.
            NoMatch(
                lambda: bailing_hybrid_example(8, layer_type="full_attention"),
                "bailing_hybrid with its attention layer only (no KDA layer)",
                reason="the rule is installed for the module but its function is never called",
            ),
            NoMatch(
                lambda: bailing_hybrid_example(8),
                "bailing_hybrid exported for 8 tokens only (static)",
                reason="the replacement declines a concrete sequence length: the original's unrolled loops are exact",
            ),
        ),
    ),
    target=tuple(f"transformers.models.{f}.modeling_{f}.chunk_kimi_delta_attention" for f in FAMILIES),
    replacement=scan_chunk_kimi_delta_attention_onnx,
)
