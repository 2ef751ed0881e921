"""OpenVINO backend fixes (stage `openvino`), in the order they run.

Node rules (`NodeRule`, phase "program") run on the captured program before `openvino.convert_model`; model
rules (`OpenVINOModelRule`, phase "model") run on the converted `openvino.Model`, before its inputs and outputs
are named. Each phase keeps the order of this list.
"""

from hfexport.rewrites.rule import Rule, load_rules

RULES: list[Rule] = load_rules(
    __name__,
    [
        # phase program: on the captured program
        "openvino/cat-drop-legacy-empty",
        "openvino/sdpa-fully-masked-rows",
        # after the zeroing of fully masked rows, which it leaves where it is (after the heads' transpose)
        "openvino/grouped-sdpa-without-repeat-kv",
        "openvino/sym-mod-to-floordiv",
        "openvino/sym-min-max-to-floordiv",
        "openvino/sym-ceil-to-int",
        "openvino/distinct-repeated-outputs",
        "openvino/quant-right-shift-as-floor-scale",
        # phase model: on the converted model
        "openvino/drop-constant-inputs",
        "openvino/exact-int-floor-divide",
        "openvino/copy-back-without-broadcast",
        # last: the outputs as they will be named
        "openvino/passthrough-outputs-own-tensor",
    ],
)
