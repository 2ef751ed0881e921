"""What the example harness and `hfexport bench` do for ExecuTorch: the Python runtime, bounded example axes,
the bench's quantizer recipes (XNNPACK's int8, torchao's 8da4w)."""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from typing import Any

from hfexport.backends.descriptor import Tools

# Upper bound of the dynamic axes of an ExecuTorch example export (every example's other_inputs fit).
EXAMPLE_BOUND = 64


def run(manager: Any, inputs: Mapping[str, Any]) -> Any:
    from torch.export.graph_signature import OutputKind

    from hfexport.runtime.executorch import ExecutorchProgram

    # The method returns the inputs it mutates first (a cache written in place); eager returns only the
    # forward's outputs, and leaves the mutation in the inputs.
    specs = manager.exported_program().graph_signature.output_specs
    mutations = sum(1 for spec in specs if spec.kind == OutputKind.USER_INPUT_MUTATION)
    return ExecutorchProgram(manager).run(inputs)[mutations:]


def structure(manager: Any) -> str:
    """The serialised program: the graph and every delegate's payload."""
    return hashlib.sha256(bytes(manager.buffer)).hexdigest()


def example_config(config: Any, inputs: Mapping[str, Any]) -> Any:
    """Every axis dynamic as `dynamic=True` makes it, but bounded at 64 instead of the model's maximum length:
    ExecuTorch plans memory for the bound, and a tiny model's max_position_embeddings (32768 for Qwen3) asks for
    more than the machine has (std::bad_alloc when the program is loaded). An axis whose sample is already longer
    (audio samples) is bounded at 4x its sample, room for the other inputs."""
    import torch

    def bound(size: int) -> Any:
        return torch.export.Dim.AUTO(max=max(EXAMPLE_BOUND, 4 * size))

    shapes = {
        k: {axis: bound(v.shape[axis]) for axis in range(v.ndim)} if isinstance(v, torch.Tensor) else None
        for k, v in inputs.items()
    }
    return dataclasses.replace(config, dynamic_shapes=shapes)


def bench_quantizer(precision: str) -> Any:
    """int8: XNNPACK's dynamic int8 activations with int8 weights per output channel. int4: torchao's 8da4w
    (`TorchAOQuantizer`: dynamic int8 activations, symmetric int4 weights in groups of 32, HQQ scales), which
    XNNPACK runs as qd8-f32-qb4w; on the code model it is more accurate than XNNPACKQuantizer's int4 per output
    channel (KL 0.0079 against 0.0137, docs/executorch.md "Int4 decode") at the same decode speed. NNCF's int4
    instead rebuilds each float weight before its linear, outside the delegate (30x slower than fp32)."""
    if precision == "int4":
        from hfexport.quantizers.torchao import TorchAOQuantizer

        return TorchAOQuantizer()
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )

    from hfexport.quantizers.pt2e import PT2EQuantizer

    recipe = get_symmetric_quantization_config(is_per_channel=True, is_dynamic=True)
    return PT2EQuantizer(XNNPACKQuantizer().set_global(recipe))


TOOLS = Tools(
    run=run,
    structure=structure,
    example_config=example_config,
    bench_quantizer=bench_quantizer,
    # A dynamic prefill graph and a static one-token decode graph, traced at batch 1: XNNPACK takes the views,
    # slices and unsqueezes of a static graph, so the decode step has fewer partitions (docs/executorch.md).
    bench_variants={
        "executorch-static-decode": {"export_format": "executorch", "dynamic": True, "static_decode": True}
    },
)
