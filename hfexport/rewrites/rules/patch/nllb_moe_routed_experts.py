"""Rule `patch/nllb-moe-routed-experts` (shared code: `_nllb_moe`)."""

from __future__ import annotations

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.patch import MethodPatch
from hfexport.rewrites.rule import RuleMeta, ScanCause
from hfexport.rewrites.rules.patch._nllb_moe import dense_ffn, expert_inputs, experts_example, routed_experts

nllb_moe_routed_experts = MethodPatch(
    RuleMeta(
        id="patch/nllb-moe-routed-experts",
        why="NLLB-MoE does not export: its experts loop over `nonzero()` of the experts hit, a data-dependent "
        "length. The replacement loops over every expert and runs each on the tokens routed to it, so its FLOPs "
        "and memory grow with tokens x experts hit (the dense form, every expert on every token: 16 experts "
        "at 512 tokens ran 137 GFLOPs of expert matmuls in 2.36 s where the routed form runs 17 in 0.30 s, "
        "tools/bench_nllb_moe.py)",
        upstream="transformers==5.24.0 models/nllb_moe/modeling_nllb_moe.py NllbMoeExperts.forward",
        scan=(
            ScanCause(
                "experts-hit-loop",
                "loop-over-nonzero",
                "forward",
                "an experts forward without the experts dispatch loops over `nonzero()` of the experts hit: a "
                "data-dependent count (Eq(u0, 0)) as soon as an expert gets no token",
            ),
        ),
        models=("nllb-moe",),
        examples=(
            Match(
                lambda: experts_example(0.2),
                "token dropout 0.2 (scaled in eval), 7 tokens, then 11 tokens",
                other_inputs=lambda: expert_inputs(11, seed=1),
            ),
            Match(
                lambda: experts_example(0.0, capacity_drop=True),
                "no token dropout, a capacity of 2 that leaves tokens without an expert",
            ),
            NoMatch(
                dense_ffn,
                "an NLLB-MoE dense feed-forward layer (no experts)",
                reason="the replacement declines only training mode (random token dropout), which an export never "
                "traces (the model is exported in eval mode), so the NoMatch is an NLLB-MoE layer without experts, "
                "where the patch is not installed",
                applies=False,
            ),
        ),
    ),
    target="transformers.models.nllb_moe.modeling_nllb_moe.NllbMoeExperts.forward",
    replacement=routed_experts,
)
