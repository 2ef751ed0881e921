"""OpenVINO backend fixes (stage `openvino`), in the order they run.

Program rules (FX, `OpenVINOFxNodeRule` / `OpenVINOFxPatternRule`) run on the captured program before
`openvino.convert_model`; model rules (`OpenVINOModelRule`) run on the converted `openvino.Model`, before
its inputs and outputs are named. Each list keeps its own order.
"""

from hfexport.rewrites.openvino import attention, concat, inputs, outputs, quant_weight_decompression, symbolic

RULES: list = [
    # on the program
    concat.drop_legacy_empty_cat_inputs,
    attention.sdpa_fully_masked_rows,
    symbolic.symbolic_mod,
    symbolic.symbolic_min_max,
    outputs.distinct_outputs,
    quant_weight_decompression.right_shift_as_floor_scale,
    # on the converted model
    inputs.drop_constant_inputs,
    symbolic.exact_int_floor_divide,
]
