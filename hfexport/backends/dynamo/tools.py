"""What the example harness and `hfexport bench` do for Dynamo: run `.module()`, compare graph code."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hfexport.backends.descriptor import Tools


def run(program: Any, inputs: Mapping[str, Any]) -> Any:
    import torch

    with torch.no_grad():
        return program.module()(**inputs)


def fx_weight_recipe(precision: str) -> Any:
    """NNCF weight compression of the FX graph: int8, or int4 symmetric in groups of 32."""
    from hfexport.quantizers.nncf import NNCFTorchFXQuantizer, NNCFWeightCompressionConfig

    if precision == "int8":
        return NNCFTorchFXQuantizer(NNCFWeightCompressionConfig(mode="int8_sym"))
    return NNCFTorchFXQuantizer(NNCFWeightCompressionConfig(mode="int4_sym", group_size=32))


TOOLS = Tools(run=run, structure=lambda program: program.graph_module.code, bench_quantizer=fx_weight_recipe)
