"""OpenVINO backend fixes (stage `openvino`), in the order they run.

Program rules (FX, `OpenVINOFxNodeRule` / `OpenVINOFxPatternRule`) run on the captured program before
`openvino.convert_model`; model rules (`OpenVINOModelRule`) run on the converted `openvino.Model`, before
its inputs and outputs are named. Each list keeps its own order.
"""

from hfexport.rewrites.openvino import attention, concat, inputs

RULES: list = [
    # on the program
    concat.drop_legacy_empty_cat_inputs,
    attention.sdpa_fully_masked_rows,
    # on the converted model
    inputs.drop_constant_inputs,
]
