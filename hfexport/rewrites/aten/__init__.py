"""ATen -> ONNX translation overrides (stage `aten`), in registration order.

Two overrides of one op overload: the later one wins, so keep at most one per overload.
"""

from hfexport.rewrites.aten import attention, checks

RULES: list = [
    attention.sdpa_masked_rows,
    checks.is_all_true,
    checks.squeeze_dim_noop,
]
