"""FX graph fixes (stage `fx`), in the order they run."""

from hfexport.rewrites.rule import Rule
from hfexport.rewrites.rules.fx.complex_to_real import complex_to_real
from hfexport.rewrites.rules.fx.fold_layout_constants import fold_layout_constants
from hfexport.rewrites.rules.fx.gen_view_after_transpose import gen_view_after_transpose

RULES: list[Rule] = [
    fold_layout_constants,
    complex_to_real,
    gen_view_after_transpose,
]
