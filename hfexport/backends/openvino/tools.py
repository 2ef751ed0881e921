"""What the example harness and `hfexport bench` do for OpenVINO: the CPU plugin (f32), NNCF's recipes."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from hfexport.backends.descriptor import Tools


def run(model: Any, inputs: Mapping[str, Any]) -> Any:
    from hfexport.runtime.openvino import OpenVINORunner

    return list(OpenVINORunner(model)(**inputs).values())


def structure(model: Any) -> list[tuple[str, str, tuple[str, ...]]]:
    """Ops, their types and their input shapes. Names OpenVINO makes up (`Constant_4108`) carry a counter of the
    process, so two conversions of one program differ there: the counter is dropped."""
    return [
        (
            re.sub(r"^([A-Za-z]+)_\d+$", r"\1", op.get_friendly_name()),
            op.get_type_name(),
            tuple(str(op.input_value(i).get_partial_shape()) for i in range(op.get_input_size())),
        )
        for op in model.get_ordered_ops()
    ]


def bench_quantizer(precision: str) -> Any:
    """NNCF int8 weights, or int4 on every layer, the embedding and the output projection too (NNCF keeps them in
    int8 by default): the int4 ceiling counts every weight at 4 bits, and a 4-layer SmolLM2-shaped decode ran 1.3x
    faster so."""
    from hfexport.quantizers.nncf import NNCFOpenVINOQuantizer, NNCFWeightCompressionConfig

    if precision == "int8":
        return NNCFOpenVINOQuantizer(NNCFWeightCompressionConfig(mode="int8_sym"))
    return NNCFOpenVINOQuantizer(NNCFWeightCompressionConfig(mode="int4_sym", group_size=32, all_layers=True))


TOOLS = Tools(
    run=run,
    structure=structure,
    bench_quantizer=bench_quantizer,
    # Stateful with transformers' dynamic cache: the CPU plugin fuses a growing cache with the attention
    # (`lowerings.openvino.make_stateful`); a static cache's writes and copies stay separate nodes.
    bench_variants={
        "openvino-stateful": {"export_format": "openvino", "dynamic": True, "stateful": True, "growing_cache": True}
    },
)
