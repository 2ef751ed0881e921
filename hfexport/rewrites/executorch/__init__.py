"""ExecuTorch backend fixes (stage `executorch`), in the order they run on the program before lowering."""

import hfexport.rewrites.executorch_kinds  # noqa: F401 - registers the stage's applier and example checker
from hfexport.rewrites.executorch import (
    conv1d_as_conv2d,
    dynamic_empty,
    dynamic_unsqueeze,
    max_values,
    quant_pt2e,
    quant_requantize,
    quant_weight_decompression,
    scatter_minmax,
    sdpa_strides,
    sort_topk,
    split_slices,
    sym_min_max,
)

RULES: list = [
    sdpa_strides.sdpa_output_contiguous_before_view,
    dynamic_unsqueeze.trailing_unsqueeze_as_view,
    conv1d_as_conv2d.conv1d_as_conv2d,
    dynamic_empty.empty_as_zeros,
    split_slices.split_as_slices,
    max_values.max_values_as_amax,
    sort_topk.sort_as_topk,
    scatter_minmax.scatter_min_max_as_masked_reduction,
    quant_pt2e.requantize_slice_with_its_input_qparams,
    quant_requantize.identity_requantize_dropped,
    quant_weight_decompression.linear_with_computed_weight_untagged,
    quant_weight_decompression.right_shift_passes_the_verifier,
    # Last: counts the calls the node rules leave in the graph.
    sym_min_max.sym_functions_pass_the_verifier,
]
