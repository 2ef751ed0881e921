"""Grouped-query attention on ExecuTorch: each key/value head attends for its query group, no `repeat_kv` copies.

On ExecuTorch the `repeat_kv` widening is an `expand_copy` that XNNPACK does not take: the portable kernel copies
the whole static cache, `groups` times over, for keys and values, in every layer and every decode step
(docs/executorch.md, "Decode profile"). The match, rewrite and examples are shared with OpenVINO's rule
(`rules/_grouped_attention.py`).
"""

from __future__ import annotations

from torch import fx

from hfexport.rewrites.kinds.fx import NodeRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules._grouped_attention import (
    GQA_MODELS,
    grouped_examples,
    is_grouped_sdpa,
    stack_query_groups,
)


def _rewrite(gm: fx.GraphModule, node: fx.Node) -> None:
    # SDPA's edge decomposition scales the query and the keys by sqrt(scale) each: the keys' product is a
    # portable op over the whole cache, so the query takes the whole scale (the `key * 1.0` left is dropped by
    # executorch/drop-identity-copies). to_edge re-decomposes SDPA with output strides under which the split back
    # into heads is not a view ("Cannot view a tensor"): a contiguous copy of the output comes first.
    stack_query_groups(gm, node, query_takes_scale=True, contiguous_output=True)


grouped_sdpa_without_repeat_kv = NodeRule(
    RuleMeta(
        id="executorch/grouped-sdpa-without-repeat-kv",
        why="repeat_kv (and SDPA's enable_gqa) widen the keys and values to the query's heads before attention; "
        "on ExecuTorch that is an expand_copy outside the XNNPACK delegate, a portable copy of the whole static "
        "cache, `groups` times over, per layer and decode step: 6 expand_copy per layer in the SmolLM2-135M "
        "decode program, about 35 MB written per token at 30 layers, 3 % of the 2-layer step in repeat_tensor "
        "(perf). Stacking each group's query heads along the query axis attends every kv head once, with the "
        "mask row of each stacked row, exactly; the query takes the whole scale, so the keys are not scaled by a "
        "portable mul over the cache either. With executorch/drop-identity-copies the 30-layer SmolLM2-135M decode "
        "went from 21.4 to 44.3 tok/s (56 -> 127 % of the matvec ceiling), tokens equal to eager's"
        "; measured by tools/ab_rules.py (the executorch-static-decode form, 4 layers at "
        "SmolLM2-135M's width, batch 1, 128-token prompt, 64 new tokens, 2-core AVX2 EPYC): decode 1.13x (169.5 "
        "against 149.9 tok/s without the rule), tokens equal",
        upstream="executorch==1.4.1 backends/xnnpack/partition/config (no expand_copy: repeat_kv of "
        "transformers==5.24.0 models/llama/modeling_llama.py runs as a portable copy)",
        backends=("executorch",),
        kind="optimization",
        models=GQA_MODELS,
        examples=grouped_examples(),
    ),
    predicate=is_grouped_sdpa,
    rewrite=_rewrite,
)
