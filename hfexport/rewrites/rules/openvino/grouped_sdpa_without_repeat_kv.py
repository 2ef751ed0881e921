"""Grouped-query attention on OpenVINO: each key/value head attends for its query group, no `repeat_kv` copies.

openvino.convert_model translates `repeat_kv` as it is written: an unsqueeze, a Broadcast (the CPU plugin's
reference kernel) or a Multiply by ones, and a Reshape of the whole static cache, for keys and values, in every
layer and decode step, with Transposes around them. The match, rewrite and examples are shared with ExecuTorch's
rule (`rules/_grouped_attention.py`).
"""

from __future__ import annotations

from torch import fx

from hfexport.rewrites.example_models import left_padded_llama
from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.fx import NodeRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules._grouped_attention import (
    GQA_MODELS,
    CachedGqaAttention,
    gqa_inputs,
    grouped_examples,
    grows_by_concatenation,
    is_grouped_sdpa,
    stack_query_groups,
)


def _matches(node: fx.Node) -> bool:
    # A cache grown by concatenation is left as repeat_kv: a stateful model's CPU plugin fuses ReadValue ->
    # Concat -> repeat_kv -> SDPA into its own attention with an in-place cache (lowerings/openvino.py,
    # `make_stateful`), whose shape inference takes the query length for the new keys' and refuses stacked rows.
    return is_grouped_sdpa(node) and not grows_by_concatenation(node)


def _rewrite(gm: fx.GraphModule, node: fx.Node) -> None:
    # The CPU plugin runs SDPA as an MHA subgraph that scales and transposes the keys, a Multiply and a Transpose
    # over the whole cache per layer and step; with the scale on the query and SDPA at scale 1 both are gone
    # (the compiled 2-layer decode graph). The output's split back into heads is a Reshape of any layout.
    stack_query_groups(gm, node, query_takes_scale=True, contiguous_output=False)


grouped_sdpa_without_repeat_kv = NodeRule(
    RuleMeta(
        id="openvino/grouped-sdpa-without-repeat-kv",
        why="openvino.convert_model translates repeat_kv (and refuses SDPA's enable_gqa) as written: per layer and "
        "decode step the compiled CPU graph broadcasts the keys and the values to every query head (an Eltwise over "
        "`groups` times the cache), transposes the widened keys, and its MHA subgraph multiplies the keys by the "
        "scale: 28-38 % of the 30-layer SmolLM2-135M decode step's node time (docs/benchmarks/history/). "
        "Stacking each group's query heads along the query axis attends every kv head once, exactly, and with the "
        "scale on the query the attention reads the cache as the scatter wrote it (no Broadcast, Transpose or "
        "Multiply of it). With openvino/copy-back-without-broadcast the 8-layer stateful decode step went from "
        "14.9 to 6.8 ms (best of 12, load 4), tokens equal to eager's. A cache grown by concatenation is left as "
        "repeat_kv: in a stateful model the CPU plugin fuses that form with the cache into one attention node "
        "(30-layer SmolLM2-135M int4 decode step 20.6 -> 8.4 ms, docs/openvino.md 'Speed beside optimum-intel'), "
        "and that node refuses stacked query rows",
        upstream="openvino==2026.4 PyTorch frontend (repeat_kv of transformers==5.24.0 "
        "models/llama/modeling_llama.py converted op by op: no GQA form of ScaledDotProductAttention is made)",
        backends=("openvino",),
        kind="optimization",
        models=GQA_MODELS,
        # convert_model refuses SDPA's enable_gqa ("Conversion is failed for aten.scaled_dot_product_attention"),
        # which the rule also stacks; without the rule there is no export to compare that example with.
        examples=(
            *grouped_examples(enable_gqa=False, grow="write"),
            NoMatch(
                lambda: (CachedGqaAttention("causal"), gqa_inputs(2, 5, 7)),
                "a cache grown by concatenation (DynamicCache)",
                reason="a stateful export's CPU plugin fuses the repeat_kv form with the cache into one attention",
            ),
            Match(
                # The CPU plugin's MHA snippet is wrong at head_dim 128 when the zeroing of fully masked rows is fused
                # into it: with the heads stacked, the zeroing still comes after the split back into heads.
                lambda: left_padded_llama(tokens=64, padded=5, head_dim=128),
                "a left-padded GQA Llama (2 query heads on 1 kv head) at head_dim 128 and 64 tokens",
                needs=("openvino/sdpa-fully-masked-rows",),
            ),
        ),
    ),
    predicate=_matches,
    rewrite=_rewrite,
)
