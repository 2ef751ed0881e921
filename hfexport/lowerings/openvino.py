"""Lower a captured `ExportedProgram` to an `openvino.Model`.

Order: stage `openvino` program fixes (FX, on the captured program) -> `openvino.convert_model(program)` ->
stage `openvino` model fixes (on the `openvino.Model`) -> named inputs and outputs. `OpenVINOExporter` saves
`output_path` as IR (`model.xml` + `model.bin`) itself, atomically, after any quantizer.

Naming follows the ONNX lowering: every model input and output is named after its place in the forward
kwargs / model output (`input_ids`, `logits`, `past_key_values.layers_0_keys`), and a name that is both an
input and an output (a cache the graph updates) becomes `input.<name>` / `output.<name>`.

Precision: the returned model computes in f32; the CPU plugin picks its compute precision at compile time
from `INFERENCE_PRECISION_HINT` (bf16 or f16 on CPUs that have them). Compile with
`{"INFERENCE_PRECISION_HINT": "f32"}` for results within 1e-4 of eager (docs/openvino.md).
"""

from __future__ import annotations

import gc
import logging
from typing import Any

import torch

from hfexport.configs import OpenVINOConfig
from hfexport.core.checkpoints import WeightSource
from hfexport.naming import INPUT_PREFIX, OUTPUT_PREFIX, paired_names, signature_names
from hfexport.rewrites import engine
from hfexport.rewrites.engine import RewriteContext

logger = logging.getLogger("hfexport")


def name_inputs_and_outputs(model: Any, input_names: list[str], output_names: list[str]) -> None:
    """Give the inputs and outputs of `model` (an `openvino.Model`) their signature names, in place."""
    inputs, outputs = paired_names(input_names, output_names)
    for port, name in zip(model.inputs, inputs, strict=True):
        port.get_tensor().set_names({name})
    for port, name in zip(model.outputs, outputs, strict=True):
        # A Result's names are its own (OpenVINO >= 2025.0), so an output that is an input passed through, or
        # one tensor returned twice, still gets one name per output.
        port.get_tensor().set_names({name})


def _conversion_failure(exc: BaseException) -> str:
    text = str(exc).strip()
    # OpenVINO's conversion report is long; its summary names the ops that failed.
    summary = text[text.find("Summary:") :] if "Summary:" in text else text[:2000]
    return f"openvino.convert_model failed: {type(exc).__name__}: {summary}"


def lower(
    program: torch.export.ExportedProgram,
    config: OpenVINOConfig,
    context: RewriteContext,
    weights: WeightSource | None = None,
) -> Any:
    """Convert `program` to an `openvino.Model` with the `openvino` stage applied; save it when asked.

    `weights` (the low-memory export): the program's FakeTensor weights become placeholders for the converter,
    and `openvino_weights.save_ir` writes them from the checkpoint when the model is saved.
    """
    import openvino as ov

    from hfexport.lowerings.openvino_weights import mark_streamed, place_weights

    # Names first: the program rules edit the graph, never the signature, but read it from the capture.
    names = signature_names(program)
    engine.apply("openvino", program, context, phase="program")
    placed = None
    if weights is not None:
        with context.stage("weights"):
            placed = place_weights(program, weights)
    with context.stage("convert", message=_conversion_failure):
        ov_model = ov.convert_model(program)
    engine.apply("openvino", ov_model, context, phase="model")
    if placed is not None:
        with context.stage("weights"):
            mark_streamed(ov_model, placed)
            # The conversion's garbage (the frontend's decomposed program, in reference cycles) freed before the
            # save, where a low-memory export peaks (docs/benchmarks.md).
            gc.collect()

    if names is None or len(names[0]) != len(ov_model.inputs) or len(names[1]) != len(ov_model.outputs):
        logger.warning("could not map the OpenVINO inputs/outputs to the forward signature; converter names kept")
    else:
        name_inputs_and_outputs(ov_model, *names)
    # The exporter saves `output_path` itself (atomically, after any quantizer).
    return ov_model


def state_pairs(model: Any) -> dict[str, str]:
    """The floating-point cache pairs of `model`: input `input.<name>` -> output `output.<name>` (the naming
    contract). Integer leaves (a static cache's `cumulative_length`) stay inputs and outputs: the CPU plugin
    keeps no i64 variable ("CPU plugin does not support i64 for use with oneDNN")."""
    outputs = {name for port in model.outputs for name in port.get_names()}
    pairs = {}
    for port in model.inputs:
        if not port.get_element_type().is_real():
            continue
        for name in port.get_names():
            if name.startswith(INPUT_PREFIX) and OUTPUT_PREFIX + name[len(INPUT_PREFIX) :] in outputs:
                pairs[name] = OUTPUT_PREFIX + name[len(INPUT_PREFIX) :]
    return pairs


def make_stateful(model: Any) -> int:
    """Turn each cache pair of `model` into an OpenVINO variable (ReadValue/Assign), in place; return how many.

    The variable of `input.<name>` is read where that input was and assigned what `output.<name>` was: the
    infer request keeps the cache between calls, and neither the input nor the output is left on the model.
    Its id is the two names joined (OpenVINO's MakeStateful naming), which `naming.variable_leaf` reads back.
    """
    from openvino._offline_transformations import apply_make_stateful_transformation

    pairs = state_pairs(model)
    if pairs:
        apply_make_stateful_transformation(model, pairs)
    return len(pairs)
