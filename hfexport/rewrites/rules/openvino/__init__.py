"""OpenVINO backend fixes (stage `openvino`), in the order they run.

Program rules (FX, `OpenVINOFxNodeRule` / `OpenVINOFxPatternRule`) run on the captured program before
`openvino.convert_model`; model rules (`OpenVINOModelRule`) run on the converted `openvino.Model`, before
its inputs and outputs are named. Each list keeps its own order.
"""

from hfexport.rewrites.rule import Rule
from hfexport.rewrites.rules.openvino.cat_drop_legacy_empty import cat_drop_legacy_empty
from hfexport.rewrites.rules.openvino.distinct_repeated_outputs import distinct_repeated_outputs
from hfexport.rewrites.rules.openvino.drop_constant_inputs import drop_constant_inputs
from hfexport.rewrites.rules.openvino.exact_int_floor_divide import exact_int_floor_divide
from hfexport.rewrites.rules.openvino.quant_right_shift_as_floor_scale import quant_right_shift_as_floor_scale
from hfexport.rewrites.rules.openvino.sdpa_fully_masked_rows import sdpa_fully_masked_rows
from hfexport.rewrites.rules.openvino.sym_min_max_to_floordiv import sym_min_max_to_floordiv
from hfexport.rewrites.rules.openvino.sym_mod_to_floordiv import sym_mod_to_floordiv

RULES: list[Rule] = [
    # on the program
    cat_drop_legacy_empty,
    sdpa_fully_masked_rows,
    sym_mod_to_floordiv,
    sym_min_max_to_floordiv,
    distinct_repeated_outputs,
    quant_right_shift_as_floor_scale,
    # on the converted model
    drop_constant_inputs,
    exact_int_floor_divide,
]
