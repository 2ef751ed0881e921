"""FX graph fixes (stage `fx`), in the order they run."""

from hfexport.rewrites.fx import complex_to_real, gen_view_after_transpose

RULES: list = [
    complex_to_real.complex_to_real,
    gen_view_after_transpose.view_after_transpose,
]
