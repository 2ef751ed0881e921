"""FX graph fixes (stage `fx`), in the order they run."""

from hfexport.rewrites.fx import complex_to_real, fold_layout_constants, gen_view_after_transpose

RULES: list = [
    fold_layout_constants.fold_layout_constants_rule,
    complex_to_real.complex_to_real,
    gen_view_after_transpose.view_after_transpose,
]
