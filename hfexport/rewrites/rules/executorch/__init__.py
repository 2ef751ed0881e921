"""ExecuTorch backend fixes (stage `executorch`), in the order they run on the program before lowering."""

from hfexport.rewrites.rule import Rule
from hfexport.rewrites.rules.executorch.dynamic_conv1d_as_conv2d import dynamic_conv1d_as_conv2d
from hfexport.rewrites.rules.executorch.dynamic_empty_as_zeros import dynamic_empty_as_zeros
from hfexport.rewrites.rules.executorch.dynamic_trailing_unsqueeze_as_view import dynamic_trailing_unsqueeze_as_view
from hfexport.rewrites.rules.executorch.integer_sort_as_topk import integer_sort_as_topk
from hfexport.rewrites.rules.executorch.max_values_as_amax import max_values_as_amax
from hfexport.rewrites.rules.executorch.quant_computed_weight_linear_untagged import (
    quant_computed_weight_linear_untagged,
)
from hfexport.rewrites.rules.executorch.quant_identity_requantize import quant_identity_requantize
from hfexport.rewrites.rules.executorch.quant_right_shift_verifier import quant_right_shift_verifier
from hfexport.rewrites.rules.executorch.quant_slice_keeps_qparams import quant_slice_keeps_qparams
from hfexport.rewrites.rules.executorch.scatter_min_max_as_masked_reduction import scatter_min_max_as_masked_reduction
from hfexport.rewrites.rules.executorch.sdpa_output_contiguous_before_view import sdpa_output_contiguous_before_view
from hfexport.rewrites.rules.executorch.split_as_slices import split_as_slices
from hfexport.rewrites.rules.executorch.sym_size_functions_verifier import sym_size_functions_verifier

RULES: list[Rule] = [
    sdpa_output_contiguous_before_view,
    dynamic_trailing_unsqueeze_as_view,
    dynamic_conv1d_as_conv2d,
    dynamic_empty_as_zeros,
    split_as_slices,
    max_values_as_amax,
    integer_sort_as_topk,
    scatter_min_max_as_masked_reduction,
    quant_slice_keeps_qparams,
    quant_identity_requantize,
    quant_computed_weight_linear_untagged,
    quant_right_shift_verifier,
    # Last: counts the calls the node rules leave in the graph.
    sym_size_functions_verifier,
]
