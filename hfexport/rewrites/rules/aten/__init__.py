"""ATen -> ONNX translation overrides (stage `aten`), in registration order.

Two overrides of one op overload: the later one wins, so keep at most one per overload.
"""

from hfexport.rewrites.rule import Rule
from hfexport.rewrites.rules.aten.is_all_true import is_all_true
from hfexport.rewrites.rules.aten.sdpa_fully_masked_rows import sdpa_fully_masked_rows
from hfexport.rewrites.rules.aten.squeeze_dim_noop import squeeze_dim_noop

RULES: list[Rule] = [
    sdpa_fully_masked_rows,
    is_all_true,
    squeeze_dim_noop,
]
