"""FX graph fixes (stage `fx`), in the order they run."""

from hfexport.rewrites.rule import Rule, load_rules

RULES: list[Rule] = load_rules(
    __name__,
    [
        "fx/fold-layout-constants",
        "fx/complex-to-real",
        "fx/gen-view-after-transpose",
        "fx/rsub-promoted-scalar",
        "fx/sym-ceil-to-int",
        "fx/mod-index-as-aten-index",
        "fx/split-symbolic-size-as-sizes",
        "fx/patch-conv-on-data-dependent-batch-as-matmul",
        "fx/untie-shared-weights",
    ],
)
