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
        _fix_cache_sizes(program, ov_model)
    # The exporter saves `output_path` itself (atomically, after any quantizer).
    return ov_model


def _fix_cache_sizes(program: torch.export.ExportedProgram, model: Any) -> None:
    """Give each cache input (`input.<name>`) the sizes the program fixed, in place.

    `convert_model` leaves every axis of an input dynamic ([?,?,?,?] for a cache of 3 heads of 64); the program
    is valid only at the sizes it was traced with on its static axes. A stateful model needs them: the empty
    cache a variable starts from (`make_stateful`) is built from its heads and head size."""
    import openvino as ov

    user = set(program.graph_signature.user_inputs)
    values = [
        node.meta.get("val")
        for node in program.graph.nodes
        if node.op == "placeholder" and node.name in user and isinstance(node.meta.get("val"), torch.Tensor)
    ]
    parameters = model.get_parameters()
    if len(values) != len(parameters):
        return
    changed = False
    for parameter, value in zip(parameters, values, strict=True):
        shape = parameter.get_partial_shape()
        if not parameter.get_output_tensor(0).get_any_name().startswith(INPUT_PREFIX):
            continue
        if shape.rank.is_dynamic or shape.rank.get_length() != value.dim():
            continue
        sizes = [
            ov.Dimension(size) if dim.is_dynamic and isinstance(size, int) else dim
            for dim, size in zip(shape, value.shape, strict=True)
        ]
        if sizes != list(shape):
            parameter.set_partial_shape(ov.PartialShape(sizes))
            changed = True
    if changed:
        model.validate_nodes_and_infer_types()


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
        _growing_caches_as_fused(model)
    return len(pairs)


def _growing_caches_as_fused(model: Any) -> int:
    """Give each variable a `Concat` grows (a dynamic cache) the form the CPU plugin fuses with its attention;
    return how many.

    The CPU plugin turns `ReadValue -> Gather(rows) -> Concat(past, new) -> [repeat_kv] -> SDPA` with `Assign` of
    the Concat into one stateful attention node that appends to the cache in place (its `StatefulSDPAFusion`, the
    form optimum-intel's exports have); the Gather (the rows of a beam search, here every row in order) and a
    variable that starts from an empty cache of the batch's size are part of that pattern. Without them the plain
    Concat copies the whole cache per layer and step and the attention is decomposed into MatMul/Softmax: a
    30-layer SmolLM2-135M int4 decode step took 20.6 ms against 8.4 ms fused (docs/openvino.md, "Speed beside
    optimum-intel"). A variable whose sizes other than batch and length are unknown is left as it is."""
    import numpy as np
    import openvino.opset13 as ops

    batch_source = next(
        (
            p
            for p in model.get_parameters()
            if p.get_partial_shape().rank.is_static and p.get_partial_shape().rank.get_length() >= 1
        ),
        None,
    )
    if batch_source is None:
        return 0
    batch = ops.gather(
        ops.shape_of(batch_source, "i64"), ops.constant(np.array([0], np.int64)), ops.constant(np.int64(0))
    )
    rows = ops.range(
        ops.constant(np.int32(0)),
        ops.convert(ops.squeeze(batch, ops.constant(np.int64(0))), "i32"),
        ops.constant(np.int32(1)),
        "i32",
    )
    fused = 0
    for read in [op for op in model.get_ordered_ops() if op.get_type_name() == "ReadValue"]:
        if read.get_input_size() != 0:
            continue
        concats = [t for t in read.output(0).get_target_inputs() if t.get_node().get_type_name() == "Concat"]
        if len(concats) != 1 or concats[0].get_index() != 0:
            continue
        concat = concats[0].get_node()
        shape = read.get_output_partial_shape(0)
        if shape.rank.is_dynamic:
            continue
        axis = concat.get_attributes()["axis"] % shape.rank.get_length()
        if axis == 0 or any(d.is_dynamic for i, d in enumerate(shape) if i not in (0, axis)):
            continue
        sizes = [0 if i in (0, axis) else d.get_length() for i, d in enumerate(shape)]
        empty = ops.concat([batch, ops.constant(np.array(sizes[1:], np.int64))], 0)
        read.set_arguments(
            [ops.broadcast(ops.constant(np.zeros((), read.get_output_element_type(0).to_dtype())), empty).output(0)]
        )
        concats[0].replace_source_output(ops.gather(read.output(0), rows, ops.constant(np.int32(0))).output(0))
        fused += 1
    if fused:
        model.validate_nodes_and_infer_types()
    return fused
