"""Rule `patch/nllb-moe-router-cast` (shared code: `_nllb_moe`)."""

from __future__ import annotations

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.patch import MethodPatch
from hfexport.rewrites.rule import RuleMeta, ScanCause
from hfexport.rewrites.rules.patch._nllb_moe import cast_classifier, dense_ffn, router_example, router_inputs

nllb_moe_router_cast = MethodPatch(
    RuleMeta(
        id="patch/nllb-moe-router-cast",
        why="NLLB-MoE does not export: its router runs `self.classifier = self.classifier.to(router_dtype)` in "
        "every forward, and `Module.to` cannot swap the fake parameters of a trace",
        upstream="transformers==5.24.0 models/nllb_moe/modeling_nllb_moe.py NllbMoeTop2Router._cast_classifier",
        scan=(
            ScanCause(
                "module-cast-in-forward",
                "module-to-in-forward",
                ".*",
                "a submodule cast with `Module.to` during the forward: the trace cannot swap its fake parameters",
            ),
        ),
        models=("nllb-moe",),
        examples=(
            Match(
                router_example,
                "router_dtype float32 as the weights, two padding tokens, then 11 tokens",
                other_inputs=lambda: router_inputs(11, seed=1),
                # The capacity ceil(fraction * tokens) of a dynamic export needs it on OpenVINO.
                needs=("openvino/sym-ceil-to-int",),
            ),
            NoMatch(
                dense_ffn,
                "an NLLB-MoE dense feed-forward layer (no router)",
                reason="the replacement declines only a cast that changes the classifier's dtype, which fails to "
                "trace with or without it (Module.to on fake parameters), so the NoMatch is an NLLB-MoE part "
                "without a router, where the patch is not installed",
                applies=False,
            ),
        ),
    ),
    target="transformers.models.nllb_moe.modeling_nllb_moe.NllbMoeTop2Router._cast_classifier",
    replacement=cast_classifier,
)
