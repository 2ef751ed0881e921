"""Lower a captured `ExportedProgram` to ONNX: `torch.onnx.ONNXProgram`.

Order: stage `aten` (translation overrides) -> `torch.onnx.export(program, custom_translation_table=...)`
-> stage `onnx` IR post-fixes -> onnxscript optimizer (stage `optimize`) -> stage `onnx` fusions
(`OnnxConfig.fusions`) -> flat, named inputs and outputs -> weights (`export_params`,
`keep_initializers_as_inputs`). `OnnxExporter` saves `output_path` itself, atomically, after any quantizer.

Naming: every graph input and output is named after its place in the forward kwargs / model output
(`input_ids`, `logits`, `cache.layers_0_keys`). A name that is both an input and an output (a cache the
graph updates) becomes `input.<name>` / `output.<name>`, so a runtime can bind the pair to one buffer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

from hfexport.configs import OnnxConfig
from hfexport.errors import HfExportError
from hfexport.rewrites import engine
from hfexport.rewrites.engine import RewriteContext

logger = logging.getLogger("hfexport")

INPUT_PREFIX = "input."
OUTPUT_PREFIX = "output."


def newest_opset() -> int:
    """The newest ONNX opset the installed onnxscript converts to (and the installed onnx knows)."""
    import onnx
    from onnxscript.version_converter import _version_converter

    return min(_version_converter.SUPPORTED_MAX_ONNX_OPSET, onnx.defs.onnx_opset_version())


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def leaf_names(tree: Any) -> list[tuple[str, Any]]:
    """`(dotted name, leaf)` for every pytree leaf of `tree`: `cache.layers_0_keys`, `logits`, ..."""
    leaves, _ = pytree.tree_flatten_with_path(tree)
    return [(".".join(_key_name(k) for k in path), leaf) for path, leaf in leaves]


def _spec_names(spec: pytree.TreeSpec, drop_first: bool) -> list[str]:
    # Tensor placeholders: a cache pytree re-flattens only its tensors as leaves (ints are context).
    dummy = pytree.tree_unflatten([torch.empty(0) for _ in range(spec.num_leaves)], spec)
    if drop_first:  # in_spec is ((args), {kwargs}); the forward is called with kwargs only
        dummy = {"": dummy[0], **dummy[1]} if dummy[0] else dummy[1]
    # A bare tensor (an lm_head's output) has the empty path; a graph value needs a name.
    return [name or "output" for name, _ in leaf_names(dummy)]


def _user_input_names(program: torch.export.ExportedProgram) -> list[str] | None:
    from torch.export.graph_signature import ConstantArgument, InputKind

    names = _spec_names(program.call_spec.in_spec, drop_first=True)
    specs = [s for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    if len(specs) != len(names):
        return None
    # torch.onnx drops constant (non-tensor) inputs such as `use_cache=True`.
    return [n for n, s in zip(names, specs, strict=True) if not isinstance(s.arg, ConstantArgument)]


def _user_output_names(program: torch.export.ExportedProgram) -> list[str] | None:
    from torch.export.graph_signature import ConstantArgument, OutputKind

    names = _spec_names(program.call_spec.out_spec, drop_first=False)
    specs = [s for s in program.graph_signature.output_specs if s.kind == OutputKind.USER_OUTPUT]
    if len(specs) != len(names):
        return None
    return [n for n, s in zip(names, specs, strict=True) if not isinstance(s.arg, ConstantArgument)]


def name_inputs_and_outputs(model: Any, input_names: list[str], output_names: list[str]) -> None:
    """Rename the graph inputs/outputs of `model` (an `onnx_ir.Model`) in place, pairing shared names."""
    import onnx_ir as ir

    graph = model.graph
    shared = set(input_names) & set(output_names)
    inputs = [INPUT_PREFIX + n if n in shared else n for n in input_names]
    outputs = [OUTPUT_PREFIX + n if n in shared else n for n in output_names]
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


def onnx_feed(input_names: list[str], sample_inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The ONNX Runtime feed (numpy arrays by graph input name) for forward kwargs `sample_inputs`."""
    from hfexport.frontends.cache_pytree import register_cache_pytrees

    register_cache_pytrees()
    flat = {name: leaf for name, leaf in leaf_names(dict(sample_inputs)) if isinstance(leaf, torch.Tensor)}
    feed = {}
    for graph_name in input_names:
        name = graph_name.removeprefix(INPUT_PREFIX)
        if name not in flat:
            raise KeyError(f"graph input {graph_name!r} has no matching sample input; inputs: {sorted(flat)}")
        feed[graph_name] = flat[name].detach().cpu().numpy()
    return feed


def _apply_weight_options(onnx_program: Any, config: OnnxConfig) -> None:
    graph = onnx_program.model.graph
    if config.keep_initializers_as_inputs:
        graph.inputs.extend(v for v in graph.initializers.values() if v not in graph.inputs)
    if not config.export_params:
        graph.initializers.clear()


def _onnx_rules(kind: str) -> engine.RuleRegistry:
    """The registered `onnx` rules of one kind ("fix" or "optimization"), in their order."""
    registry = engine.RuleRegistry(universe=engine.default_registry())
    for rule in engine.default_registry().rules("onnx"):
        if rule.meta.kind == kind:
            registry.register(rule)
    return registry


def lower(program: torch.export.ExportedProgram, config: OnnxConfig, context: RewriteContext) -> Any:
    """Lower `program` to a `torch.onnx.ONNXProgram` with the `aten` and `onnx` stages applied."""
    import onnxscript
    import torch.onnx

    from hfexport.rewrites.kinds.onnx import build_translation_table

    opset = config.opset_version or newest_opset()
    table = build_translation_table(context, opset)
    context.current_stage = "translate"
    start = time.perf_counter()
    try:
        onnx_program = torch.onnx.export(
            program,
            (),
            dynamo=True,
            custom_translation_table=table.functions or None,
            opset_version=opset,
            optimize=False,
            verbose=False,
        )
    except Exception as exc:
        raise HfExportError(f"{type(exc).__name__}: {exc}", stage="translate") from exc
    finally:
        table.finish()
        context.stage_seconds["translate"] = time.perf_counter() - start

    try:
        engine.apply("onnx", onnx_program.model, context, _onnx_rules("fix"))
    except Exception as exc:
        raise HfExportError(f"{type(exc).__name__}: {exc}", stage="onnx", rule_id=context.current_rule) from exc

    if config.optimize:
        context.current_stage = "optimize"
        start = time.perf_counter()
        try:
            onnx_program.model = onnxscript.optimizer.optimize(onnx_program.model)
        except Exception as exc:
            raise HfExportError(f"{type(exc).__name__}: {exc}", stage="optimize") from exc
        context.stage_seconds["optimize"] = time.perf_counter() - start

    # Fusions match the optimized graph (constants folded, no-op casts gone) and their contrib ops stay out
    # of the optimizer's way.
    fusions = _onnx_rules("optimization")
    if config.fusions is None:
        for rule in fusions.rules("onnx"):
            context.skip(rule, "disabled", "OnnxConfig.fusions is None")
    else:
        try:
            engine.apply("onnx", onnx_program.model, context, fusions)
        except Exception as exc:
            raise HfExportError(f"{type(exc).__name__}: {exc}", stage="onnx", rule_id=context.current_rule) from exc
        # What the fused nodes replaced but other patterns shared (e.g. the Unsqueeze of cos feeding both
        # the query and the key rotation), and constants only the old nodes read.
        # Fused nodes built per site (the rotary caches of q and k) are computed once.
        from onnx_ir.passes.common import CommonSubexpressionEliminationPass, RemoveUnusedNodesPass

        RemoveUnusedNodesPass()(onnx_program.model)
        CommonSubexpressionEliminationPass()(onnx_program.model)

    input_names, output_names = _user_input_names(program), _user_output_names(program)
    graph = onnx_program.model.graph
    if input_names is None or output_names is None or len(input_names) != len(graph.inputs):
        logger.warning("could not map the ONNX inputs/outputs to the forward signature; torch.onnx names kept")
    elif len(output_names) != len(graph.outputs):
        logger.warning("could not map the ONNX outputs to the model outputs; torch.onnx names kept")
    else:
        name_inputs_and_outputs(onnx_program.model, input_names, output_names)

    # The exporter saves `output_path` itself (atomically, after any quantizer), with these options applied.
    _apply_weight_options(onnx_program, config)
    return onnx_program
