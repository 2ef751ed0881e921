"""ExecuTorch backend fixes (stage `executorch`), in the order they run on the program before lowering."""

import hfexport.rewrites.executorch_kinds  # noqa: F401 - registers the stage's applier and example checker
from hfexport.rewrites.executorch import sdpa_strides

RULES: list = [
    sdpa_strides.sdpa_output_contiguous_before_view,
]
