"""How the ops of an FX program are counted: the Dynamo result, and the FX graph every capture backend starts from."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

from hfexport.backends.descriptor import Ops

_LOW_PRECISION = ("int8", "uint8", "int16", "int32")
_QUANTIZATION_NAMESPACES = ("quantized_decomposed", "torchao")


def fx_op_counts(program: Any) -> Counter[str]:
    """Every `call_function` of an `ExportedProgram` or `GraphModule` by target, and `compressed_constant.<dtype>`
    for each integer weight (at least 2-D) among its state and constants."""
    import torch

    exported = isinstance(program, torch.export.ExportedProgram)
    graph_module = program.graph_module if exported else program
    counts = Counter(str(n.target) for n in graph_module.graph.nodes if n.op == "call_function")
    tensors: dict[str, Any] = {}
    if exported:
        tensors.update(program.state_dict)
        tensors.update(program.constants)
    else:
        tensors.update(dict(graph_module.named_parameters()))
        tensors.update(dict(graph_module.named_buffers()))
    for value in tensors.values():
        dtype = str(getattr(value, "dtype", "")).removeprefix("torch.")
        if isinstance(value, torch.Tensor) and dtype in _LOW_PRECISION and value.ndim >= 2:
            counts[f"compressed_constant.{dtype}"] += 1
    return counts


def fx_quantized_op_counts(program: Any) -> dict[str, int]:
    """The quantize/dequantize ops (by op, without `.default`) and compressed weights of an FX program."""
    counts: Counter[str] = Counter()
    for name, count in fx_op_counts(program).items():
        namespace = name.split(".", 1)[0]
        if name.startswith("compressed_constant."):
            counts[name] += count
        elif namespace in _QUANTIZATION_NAMESPACES or "quantize" in name:
            counts[name.removesuffix(".default")] += count
    return dict(counts)


def _runtime_op_counts(folder: Path) -> tuple[str, Counter[str]]:
    import torch

    counts: Counter[str] = Counter()
    for path in sorted(Path(folder).rglob("*.pt2")):
        counts.update(fx_op_counts(torch.export.load(str(path))))  # the artifact an audit saved itself
    return "the exported ATen graph", counts


OPS = Ops(op_counts=fx_op_counts, quantized_op_counts=fx_quantized_op_counts, runtime_op_counts=_runtime_op_counts)
