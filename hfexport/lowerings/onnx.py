"""Lower a captured `ExportedProgram` to ONNX: `torch.onnx.ONNXProgram`.

Order: stage `aten` (translation overrides) -> torch.onnx's translation (`onnx_translate.translate`)
-> stage `onnx` IR post-fixes -> onnxscript optimizer (stage `optimize`) -> stage `onnx` fusions
(`OnnxConfig.fusions`) -> flat, named inputs and outputs -> weights (`export_params`,
`keep_initializers_as_inputs`). `OnnxExporter` saves `output_path` itself, atomically, after any quantizer.

Low-memory export (`OnnxConfig(low_memory=True)`): the program's weights are FakeTensors; right after
translation each such initializer gets a lazy value that reads its checkpoint tensor when asked
(`stream_weights`), so the optimizer and the `onnx` rules see the same values as on the in-memory path and
the save writes the `.onnx.data` file tensor by tensor.

Naming follows `hfexport.naming`.
"""

from __future__ import annotations

import functools
import gc
import json
import logging
from typing import Any

import torch

from hfexport.configs import OnnxConfig
from hfexport.core.checkpoints import WeightSource
from hfexport.core.errors import HfExportError
from hfexport.generation_spec import LAYOUT_META, LAYOUT_METADATA_KEY
from hfexport.lowerings.onnx_optimizer import optimize
from hfexport.lowerings.onnx_translate import translate
from hfexport.naming import paired_names, user_input_names, user_output_names

__all__ = [
    "lower",
    "name_inputs_and_outputs",
    "newest_opset",
    "stream_weights",
]
from hfexport.rewrites import engine
from hfexport.rewrites.engine import RewriteContext

logger = logging.getLogger("hfexport")


def newest_opset() -> int:
    """The newest ONNX opset the installed onnxscript converts to (and the installed onnx knows)."""
    import onnx
    from onnxscript.version_converter import _version_converter

    return min(_version_converter.SUPPORTED_MAX_ONNX_OPSET, onnx.defs.onnx_opset_version())


def name_inputs_and_outputs(model: Any, input_names: list[str], output_names: list[str]) -> None:
    """Rename the graph inputs/outputs of `model` (an `onnx_ir.Model`) in place, pairing shared names."""
    import onnx_ir as ir

    graph = model.graph
    inputs, outputs = paired_names(input_names, output_names)
    wanted = set(inputs) | set(outputs)
    # An output that is also an input, an initializer or an earlier output cannot carry a second name:
    # give it its own value through an Identity.
    taken: set[int] = {id(v) for v in graph.inputs} | {id(v) for v in graph.initializers.values()}
    for i, value in enumerate(list(graph.outputs)):
        if id(value) in taken:
            node = ir.node("Identity", [value])
            graph.append(node)
            graph.outputs[i] = node.outputs[0]
        taken.add(id(graph.outputs[i]))
    io = {id(v) for v in (*graph.inputs, *graph.outputs)}
    for node in graph:
        for value in node.outputs:
            if value.name in wanted and id(value) not in io:
                value.name = f"{value.name}__inner"
    for value in graph.initializers.values():
        if value.name in wanted:
            raise HfExportError(f"a weight is named {value.name!r}, like a graph input or output", stage="onnx")
    for value, name in zip(graph.inputs, inputs, strict=True):
        value.name = name
    for value, name in zip(graph.outputs, outputs, strict=True):
        value.name = name


def _apply_weight_options(onnx_program: Any, config: OnnxConfig) -> None:
    graph = onnx_program.model.graph
    if config.keep_initializers_as_inputs:
        graph.inputs.extend(v for v in graph.initializers.values() if v not in graph.inputs)
    if not config.export_params:
        graph.initializers.clear()


def _read_weight(
    source: WeightSource, key: str, dtype: torch.dtype, name: str, perm: tuple[int, ...] | None = None
) -> Any:
    from onnx_ir.tensor_adapters import TorchTensor

    tensor = source.checkpoint.load(key, dtype)
    if perm is not None:
        tensor = tensor.permute(perm).contiguous()
    return TorchTensor(tensor, name)


# Model metadata of a low-memory export: {initializer name: [checkpoint tensor, permutation or null]} as JSON, so a
# saved artifact's weights (folded transposes included) can be checked against the checkpoint afterwards.
STREAMED_KEY = "hfexport.streamed_weights"


# onnxscript's constant folding (optimizer/_constant_folding.py, onnxscript 0.7.2): a Transpose of an
# initializer is folded when the initializer has at most this many elements or the Transpose is its only consumer.
_FOLD_INPUT_SIZE_LIMIT = 8192


def _fold_streamed_transposes(
    model: Any, streamed: dict[int, tuple[str, torch.dtype]], source: WeightSource, record: dict[str, Any]
) -> int:
    """Fold `Transpose(weight)` of streamed weights into lazy transposed initializers, as the optimizer would.

    torchlib translates a linear layer as MatMul(x, Transpose(W)); the onnxscript optimizer folds that
    Transpose into a new initializer (computed in memory, kept until the save), so left to it every linear weight
    of a model larger than memory would be read and held. Here the same fold happens, on the same sites and under
    the same name (the Transpose's output), with a value that transposes the checkpoint tensor only when written.
    """
    import onnx_ir as ir

    from hfexport.lowerings.onnx_weights import StreamedTensor, write_rows

    folded = 0
    graph = model.graph
    for node in list(graph):
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx") or len(node.inputs) != 1:
            continue
        weight = node.inputs[0]
        if weight is None or id(weight.const_value) not in streamed:
            continue
        if weight.const_value.size > _FOLD_INPUT_SIZE_LIMIT and len(weight.uses()) != 1:
            continue
        key, dtype = streamed[id(weight.const_value)]
        rank = len(weight.const_value.shape)
        perm_attr = node.attributes.get("perm")
        perm = tuple(perm_attr.as_ints()) if perm_attr is not None else tuple(reversed(range(rank)))
        output = node.outputs[0]
        shape = ir.Shape([weight.const_value.shape[i] for i in perm])
        read = functools.partial(_read_weight, source, key, dtype, output.name, perm)
        write = functools.partial(write_rows, checkpoint=source.checkpoint, key=key, dtype=dtype, perm=perm)
        value = ir.Value(
            name=output.name,
            shape=shape,
            type=ir.TensorType(weight.const_value.dtype),
            const_value=StreamedTensor(read, write, dtype=weight.const_value.dtype, shape=shape, name=output.name),
        )
        record[output.name] = [key, list(perm)]
        output.replace_all_uses_with(value, replace_graph_outputs=True)
        graph.remove(node, safe=True)
        output.name = f"{output.name}__folded"
        graph.register_initializer(value)
        folded += 1
    return folded


def stream_weights(model: Any, source: WeightSource, fold_transposes: bool = True) -> int:
    """Give every initializer of `model` (an `onnx_ir.Model`) whose value is a FakeTensor a lazy value that
    reads its checkpoint tensor (cast to the initializer's dtype: `--dtype` applies while streaming) each time
    its bytes are asked for, and keeps nothing. Returns how many initializers were given one.

    Refuses an empty initializer that no checkpoint tensor holds (a weight the capture computed from other
    weights would need them in memory). `fold_transposes` (when the optimizer runs) folds transposed weights
    lazily, as the optimizer would fold them in memory (`_fold_streamed_transposes`).
    """
    import onnx_ir as ir

    from hfexport.frontends.empty_weights import is_empty
    from hfexport.lowerings.onnx_weights import StreamedTensor, write_rows

    streamed: dict[int, tuple[str, torch.dtype]] = {}
    record: dict[str, Any] = {}
    for name, value in model.graph.initializers.items():
        raw = getattr(value.const_value, "raw", None)
        if not isinstance(raw, torch.Tensor) or not is_empty(raw):
            continue
        key = source.key_of(name, "initializer")
        read = functools.partial(_read_weight, source, key, raw.dtype, name)
        # Written in blocks of rows by the save (onnx_weights: the whole tensor is never held for it).
        write = functools.partial(write_rows, checkpoint=source.checkpoint, key=key, dtype=raw.dtype)
        shape = ir.Shape(raw.shape)
        value.const_value = StreamedTensor(read, write, dtype=value.const_value.dtype, shape=shape, name=name)
        record[name] = [key, None]
        streamed[id(value.const_value)] = (key, raw.dtype)
    if fold_transposes:
        _fold_streamed_transposes(model, streamed, source, record)
    model.metadata_props[STREAMED_KEY] = json.dumps(record, sort_keys=True)
    return len(streamed)


def rewrite_quantized(onnx_program: Any, context: RewriteContext) -> None:
    """Stage `onnx`'s last phase, "quantized", on the model the quantizer returned (or the lowered one, without a
    quantizer): the rules that rewrite what a quantizer writes (e.g. NNCF's dequantized tables)."""
    hits = engine.apply("onnx", onnx_program.model, context, phase="quantized", step="onnx-quantized").hits
    if any(hits.values()):
        from onnx_ir.passes.common import RemoveUnusedNodesPass

        RemoveUnusedNodesPass()(onnx_program.model)
        onnx_program.release()  # a session built before the rewrite would run the old graph


def lower(
    program: torch.export.ExportedProgram,
    config: OnnxConfig,
    context: RewriteContext,
    weights: WeightSource | None = None,
) -> Any:
    """Lower `program` to a `torch.onnx.ONNXProgram` with the `aten` and `onnx` stages applied.

    `weights` (the low-memory export) gives the FakeTensor weights lazy values read from a checkpoint.

    Fusions (`kind="optimization"` rules of stage `onnx`) are switched by the rule selection: the exporter
    turns `OnnxConfig(fusions=None)` into a selection that disables them, so the report says why.
    """
    opset = config.opset_version or newest_opset()
    # The overrides' translations, each counting its dispatches during the translation below.
    table = dict(engine.apply("aten", opset, context).outputs)
    with context.stage("translate"):
        onnx_program, _ = translate(program, table, opset)
    if weights is not None:
        with context.stage("weights"):
            stream_weights(onnx_program.model, weights, fold_transposes=config.optimize)
            # The decomposed program torch.onnx translated (ONNXProgram keeps it only for its repr) and the
            # translation's garbage (~145k objects in reference cycles on a 30-layer model) freed now: a low-memory
            # export peaks in the optimizer or the save, which reuse that memory (docs/benchmarks.md).
            onnx_program.exported_program = None
            gc.collect()

    engine.apply("onnx", onnx_program.model, context, phase="fix")

    if config.optimize:
        with context.stage("optimize"):
            onnx_program.model = optimize(onnx_program.model)

    # Fusions match the optimized graph (constants folded, no-op casts gone) and their contrib ops stay out
    # of the optimizer's way.
    fusions = engine.apply("onnx", onnx_program.model, context, phase="fusion").hits
    if fusions:  # at least one fusion rule ran (fired or not), as before the selection decided this
        # What the fused nodes replaced but other patterns shared (e.g. the Unsqueeze of cos feeding both
        # the query and the key rotation), and constants only the old nodes read.
        # Fused nodes built per site (the rotary caches of q and k) are computed once.
        from onnx_ir.passes.common import CommonSubexpressionEliminationPass, RemoveUnusedNodesPass

        RemoveUnusedNodesPass()(onnx_program.model)
        CommonSubexpressionEliminationPass()(onnx_program.model)

    input_names, output_names = user_input_names(program), user_output_names(program)
    graph = onnx_program.model.graph
    if input_names is None or output_names is None or len(input_names) != len(graph.inputs):
        logger.warning("could not map the ONNX inputs/outputs to the forward signature; torch.onnx names kept")
    elif len(output_names) != len(graph.outputs):
        logger.warning("could not map the ONNX outputs to the model outputs; torch.onnx names kept")
    else:
        name_inputs_and_outputs(onnx_program.model, input_names, output_names)

    layout = program.graph_module.meta.get(LAYOUT_META)
    if layout:
        # torch.onnx drops the program's layout assertion: the runner checks the feed against this instead.
        onnx_program.model.metadata_props[LAYOUT_METADATA_KEY] = json.dumps(layout, sort_keys=True)

    # The exporter saves `output_path` itself (atomically, after any quantizer), with these options applied.
    _apply_weight_options(onnx_program, config)
    return onnx_program
