"""How the ops of an OpenVINO model are counted: op types, and compressed (integer) weight constants."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from hfexport.backends.descriptor import Ops

_COMPRESSED = ("i8", "u8", "i4", "u4", "nf4", "f8e4m3", "f8e5m2")


def op_counts(model: Any) -> Counter[str]:
    """Every op of an `openvino.Model` by type, and `compressed_constant.<element type>` for each integer weight."""
    counts: Counter[str] = Counter()
    for op in model.get_ordered_ops():
        kind = op.get_type_name()
        counts[kind] += 1
        if kind == "Constant":
            element = op.get_output_element_type(0).get_type_name()
            if element in _COMPRESSED and len(op.get_output_shape(0)) >= 2:
                counts[f"compressed_constant.{element}"] += 1
    return counts


def quantized_op_counts(model: Any) -> dict[str, int]:
    """FakeQuantize ops and integer (compressed) weight constants of an `openvino.Model`."""
    return {k: v for k, v in op_counts(model).items() if k == "FakeQuantize" or k.startswith("compressed_constant.")}


def _runtime_op_counts(folder: Path) -> tuple[str, Counter[str]]:
    """The compiled CPU model's layers (after OpenVINO's own fusions)."""
    import openvino as ov

    core = ov.Core()
    counts: Counter[str] = Counter()
    for path in sorted(Path(folder).rglob("*.xml")):
        runtime = core.compile_model(str(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"}).get_runtime_model()
        counts.update(op.get_rt_info()["layerType"].astype(str) for op in runtime.get_ordered_ops())
    return "OpenVINO's compiled CPU model", counts


OPS = Ops(op_counts=op_counts, quantized_op_counts=quantized_op_counts, runtime_op_counts=_runtime_op_counts)
