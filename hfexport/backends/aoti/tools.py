"""What the example harness and `hfexport bench` do for AOTInductor: run the package, compare its FX program."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hfexport.backends.descriptor import Tools


def run(package: Any, inputs: Mapping[str, Any]) -> Any:
    return list(package(**inputs).values())


def bench_quantizer(precision: str) -> Any:
    """As for Dynamo: NNCF weight compression of the FX graph, which AOTInductor then compiles."""
    from hfexport.backends.dynamo.tools import fx_weight_recipe

    return fx_weight_recipe(precision)


TOOLS = Tools(run=run, structure=lambda package: package.graph_code, bench_quantizer=bench_quantizer)
