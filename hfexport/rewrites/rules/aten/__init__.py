"""ATen -> ONNX translation overrides (stage `aten`), in registration order.

Two overrides of one op overload: the later one wins, so keep at most one per overload.
"""

from hfexport.rewrites.rule import Rule, load_rules

RULES: list[Rule] = load_rules(
    __name__,
    [
        "aten/sdpa-fully-masked-rows",
        "aten/sdpa-broadcast-kv-heads",
        "aten/is-all-true",
        "aten/squeeze-dim-noop",
        "aten/grouped-mm-fallback",
        "aten/erf-inv",
        "aten/histc-data-range",
        "aten/int64-sum-exact",
        "aten/unsigned-right-shift",
    ],
)
