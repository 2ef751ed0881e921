"""The `translate` stage of the ONNX lowering: torch.onnx's translation, without its re-trace where nothing needs it.

`torch.onnx.export(program)` first re-traces the whole program (`ExportedProgram.run_decompositions` with its
ONNX decomposition table), then translates each node with torchlib. The re-trace functionalises in-place ops and
decomposes the ops torchlib does not implement; on a decoder it is most of the stage: 21 of the 28.5 s of a
30-layer SmolLM2-shaped export, ~8 ms a node, almost all of it symbolic-shape arithmetic, with an empty table as
with torch.onnx's (4.7 vs 5.9 s on 8 layers).

A captured decoder asks little of it. On that Llama every node is one torchlib translates as it is, but for
- the static cache's writes into its inputs (`index_copy_`, `add_`): functionalised by a local edit,
  `frontends.functionalize.functionalize_input_writes` (the form the re-trace gives: functional ops and
  `USER_INPUT_MUTATION` outputs);
- the functional `index_copy` of those writes: torch.onnx's table decomposes it, into `index_put` with the index at
  its axis (`None` before it) for a 1-D index, and that is what it becomes here;
- `aten.to.dtype` / `aten.to.device`: composite ops the re-trace turns into `_to_copy`, or drops where they change
  nothing; here the same;
- `reshape`: its `-1` sizes that the output knows written out, as its decomposition writes them (the
  decomposition's `view` or `clone` + `_unsafe_view` is a `Reshape` in ONNX, as `reshape` is);
- composite ops that are another op under another name (`__and__` is `bitwise_and`) and `detach`, which the
  re-trace drops;
- `_assert_tensor_metadata` and the other assertion nodes, which torch.onnx removes after its re-trace too.

`translate` makes those edits and, when every remaining call is one torchlib implements and torch.onnx's table
would not decompose, no op writes in place and no higher-order op is left, translates the program with torch.onnx's
own passes (type promotion, assertion removal) and translator; otherwise it hands the program to
`torch.onnx.export`, re-trace and all; so does a failure of those passes (torch.onnx's type promotion propagates
fake values through the graph again, and a `view` of an op whose output layout differs from the one the capture
recorded, SDPA's in T5, fails there). The edits are made on a copy of the graph: the fallback gets the program as
captured.
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch

logger = logging.getLogger(__name__)

_TO = (torch.ops.aten.to.dtype, torch.ops.aten.to.device, torch.ops.aten.to.dtype_layout)
# Composite ops that are another op under another name (their decomposition is that call).
_RENAMED = {
    torch.ops.aten.__and__.Tensor: torch.ops.aten.bitwise_and.Tensor,
    torch.ops.aten.__or__.Tensor: torch.ops.aten.bitwise_or.Tensor,
    torch.ops.aten.__xor__.Tensor: torch.ops.aten.bitwise_xor.Tensor,
}
# Ops that return their input as it is in an inference graph.
_IDENTITIES = (torch.ops.aten.detach.default, torch.ops.aten.detach_.default, torch.ops.aten.alias.default)
# Calls that are not ATen ops but that torch.onnx translates from any program (symbolic-size arithmetic).
_PYTHON_CALLS = (operator.getitem,)


def _copy(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """A program with its own graph (nodes and their metadata dicts copied, the values in them shared) and the same
    weights: the edits below go there, and the re-trace, where one is needed after all, gets `program` untouched."""
    import copy

    graph = torch.fx.Graph()
    graph._codegen = copy.deepcopy(program.graph._codegen)
    values: dict[torch.fx.Node, torch.fx.Node] = {}
    output = next(node for node in reversed(program.graph.nodes) if node.op == "output")
    result = graph.graph_copy(program.graph, values)
    graph.output(result).meta = dict(output.meta)
    module = torch.fx.GraphModule(program.graph_module, graph)
    module.meta.update(program.graph_module.meta)
    return torch.export.ExportedProgram(
        root=module,
        graph=graph,
        graph_signature=copy.deepcopy(program.graph_signature),
        state_dict=program.state_dict,
        range_constraints=program.range_constraints,
        module_call_graph=copy.deepcopy(program.module_call_graph),
        example_inputs=program.example_inputs,
        constants=program.constants,
        verifiers=[program.verifier],
    )


def _replace(program: torch.export.ExportedProgram, node: torch.fx.Node, new: torch.fx.Node) -> None:
    """`new` in place of `node`, with its metadata, in the graph and in the graph signature (which names values by
    node name)."""
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    node.graph.erase_node(node)
    program.graph_signature.replace_all_uses(node.name, new.name)


def _bypass(program: torch.export.ExportedProgram, node: torch.fx.Node, source: torch.fx.Node) -> None:
    """Drop `node`, which returns `source` unchanged: its readers (and the graph signature) read `source`."""
    node.replace_all_uses_with(source)
    node.graph.erase_node(node)
    program.graph_signature.replace_all_uses(node.name, source.name)


def _to_copy_calls(program: torch.export.ExportedProgram) -> int:
    """Replace each `aten.to.dtype(x, dtype)` / `aten.to.device(x, device, dtype)` whose copy/memory_format
    arguments are the defaults by what the re-trace leaves: `x` itself where the dtype and device stay, else
    `aten._to_copy(x, dtype=..., device=...)`. Returns how many."""
    graph = program.graph_module.graph
    replaced = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in _TO:
            continue
        names = [argument.name for argument in node.target._schema.arguments]
        bound = dict(zip(names, node.args, strict=False)) | dict(node.kwargs)
        if bound.get("non_blocking") or bound.get("copy") or bound.get("memory_format") is not None:
            continue
        if bound.get("layout") not in (None, torch.strided) or bound.get("pin_memory"):
            continue
        value, source = node.meta.get("val"), getattr(bound["self"], "meta", {}).get("val")
        if not isinstance(value, torch.Tensor) or not isinstance(source, torch.Tensor):
            continue
        if (value.dtype, value.device) == (source.dtype, source.device):
            # `to` returns its input unchanged: the re-trace leaves no node, and neither does this.
            _bypass(program, node, bound["self"])
            replaced += 1
            continue
        with graph.inserting_before(node):
            copy = graph.call_function(
                torch.ops.aten._to_copy.default, (bound["self"],), {"dtype": value.dtype, "device": value.device}
            )
        _replace(program, node, copy)
        replaced += 1
    return replaced


def _index_copy_as_index_put(program: torch.export.ExportedProgram) -> int:
    """Replace each `aten.index_copy(x, dim, index, source)` with a 1-D index and a source of x's rank by
    `aten.index_put(x, [None] * dim + [index], source)`: what its decomposition gives for that case (the static
    cache's write). Returns how many."""
    graph = program.graph_module.graph
    replaced = 0
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.index_copy.default or node.kwargs:
            continue
        x, dim, index, source = node.args
        values = [getattr(n, "meta", {}).get("val") for n in (x, index, source)]
        if not all(isinstance(v, torch.Tensor) for v in values) or not isinstance(dim, int):
            continue
        x_value, index_value, source_value = values
        if index_value.dim() != 1 or source_value.dim() != x_value.dim() or x_value.dim() == 0:
            continue
        with graph.inserting_before(node):
            put = graph.call_function(
                torch.ops.aten.index_put.default, (x, [None] * (dim % x_value.dim()) + [index], source)
            )
        _replace(program, node, put)
        replaced += 1
    return replaced


def _reshape_sizes(program: torch.export.ExportedProgram) -> int:
    """Write the `-1` of each `reshape(x, shape)` whose size the output has as a number as that number, as the
    re-trace's decomposition of `reshape` writes it (into a `view`, or a `clone` and `_unsafe_view`: all of them a
    `Reshape` in ONNX, so the op stays `reshape`). Returns how many nodes changed."""
    graph = program.graph_module.graph
    changed = 0
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten.reshape.default or len(node.args) != 2:
            continue
        source, shape = node.args
        result = node.meta.get("val")
        if not isinstance(result, torch.Tensor) or not isinstance(shape, list | tuple) or len(shape) != result.dim():
            continue
        sizes = [
            out if isinstance(size, int) and size == -1 and isinstance(out, int) else size
            for size, out in zip(shape, result.shape, strict=True)
        ]
        if sizes != list(shape):
            node.args = (source, sizes)
            changed += 1
    return changed


def _renamed_and_identity_calls(program: torch.export.ExportedProgram) -> int:
    """`x & y` (`aten.__and__`) as `bitwise_and` and the like (`_RENAMED`), and `detach`/`alias` dropped (they
    return their input), as the re-trace leaves them. Returns how many nodes changed."""
    graph = program.graph_module.graph
    changed = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in _RENAMED:
            with graph.inserting_before(node):
                new = graph.call_function(_RENAMED[node.target], tuple(node.args), dict(node.kwargs))
            _replace(program, node, new)
        elif node.target in _IDENTITIES and isinstance(node.args[0], torch.fx.Node):
            _bypass(program, node, node.args[0])
        else:
            continue
        changed += 1
    return changed


def unsupported_calls(program: torch.export.ExportedProgram, registry: Any, table: dict[Any, Any]) -> list[str]:
    """The calls of `program` that need torch.onnx's re-trace: ops torchlib does not implement or that its
    decomposition table decomposes, in-place ops, and anything that is neither an ATen op nor a symbolic-size
    operation (higher-order ops, Python callables). Empty: the program translates as it is."""
    needs: set[str] = set()
    targets = [spec.target for spec in program.graph_signature.input_specs if spec.target is not None]
    if len(targets) != len(set(targets)):
        # One weight behind several placeholders (`fx/untie-shared-weights`): the translator names initializers by
        # target, so the second placeholder would read an initializer the graph does not have; the re-trace lifts
        # each placeholder again.
        needs.add("a weight read through several placeholders")
    for node in program.graph.nodes:
        if node.op == "output" and any(value is None for value in torch.utils._pytree.tree_leaves(node.args)):
            needs.add("a None output")  # the re-trace leaves it out of the graph (CLIP's unkept hidden states)
        if node.op != "call_function":
            continue
        target = node.target
        if target in _PYTHON_CALLS or _is_symbolic_size_op(node):
            continue
        if _is_assertion(target):
            continue
        translatable = (
            isinstance(target, torch._ops.OpOverload)
            and not target._schema.is_mutable
            and target not in table
            and registry.is_registered(target)
        )
        if not translatable:
            needs.add(str(target))
    return sorted(needs)


def _is_assertion(target: Any) -> bool:
    return target in {
        torch.ops.aten.sym_constrain_range_for_size.default,
        torch.ops.aten._assert_async.default,
        torch.ops.aten._assert_async.msg,
        torch.ops.aten._assert_scalar.default,
        torch.ops.aten._assert_tensor_metadata.default,
    }


def _is_symbolic_size_op(node: torch.fx.Node) -> bool:
    """`sym_size`, and the Python arithmetic on symbolic sizes (`operator.mul`, `sym_max`...) that export records:
    torch.onnx translates these from the graph it is given, re-traced or not."""
    from torch.fx.experimental.sym_node import SymTypes

    target = node.target
    if target in (
        torch.ops.aten.sym_size.int,
        torch.ops.aten.sym_stride.int,
        torch.ops.aten.sym_numel.default,
        torch.ops.aten.sym_storage_offset.default,
    ):
        return True
    value = node.meta.get("val")
    return not isinstance(target, torch._ops.OpOverload) and isinstance(value, SymTypes) and callable(target)


def registry_for(opset: int, table: dict[Any, Any] | None) -> Any:
    """torchlib's registry at `opset` with `table`'s translations (the `aten` rules' overrides) registered over it,
    as `torch.onnx.export(custom_translation_table=...)` builds it."""
    from torch.onnx._internal.exporter import _constants, _registration

    registry = _registration.ONNXRegistry.from_torchlib(opset_version=max(opset, _constants.TORCHLIB_OPSET))
    for op, translation in (table or {}).items():
        registry.register_op(op, translation, is_complex=False)
    return registry


def translate(
    program: torch.export.ExportedProgram, table: dict[Any, Any] | None, opset: int, retrace: bool = False
) -> tuple[Any, bool]:
    """`program` as a `torch.onnx.ONNXProgram` at `opset` with `table`'s translations, and whether the re-trace was
    skipped. `program` itself is left as it is. `retrace=True` always takes torch.onnx's path."""
    if retrace:
        return _export(program, table, opset), False
    try:
        onnx_program = _translate_as_captured(program, table, opset)
    except Exception as exc:  # what the re-trace would have made translatable: its path, with its own errors
        logger.debug("translation without re-trace failed (%s: %s); re-tracing", type(exc).__name__, exc)
        onnx_program = None
    if onnx_program is None:
        return _export(program, table, opset), False
    return onnx_program, True


def _translate_as_captured(program: torch.export.ExportedProgram, table: dict[Any, Any] | None, opset: int) -> Any:
    """The ONNX program of a copy of `program` with the local edits, translated without re-trace; None where a call
    needs the re-trace (`unsupported_calls`) or torch.onnx's internals are not there."""
    from hfexport.frontends.functionalize import functionalize_input_writes

    try:
        from torch.onnx._internal._lazy_import import onnxscript_apis
        from torch.onnx._internal.exporter import _core, _decomp, _fx_passes
    except ImportError:  # another torch: torch.onnx's public path
        return None
    program = _copy(program)
    program = functionalize_input_writes(program) or program
    _to_copy_calls(program)
    _index_copy_as_index_put(program)
    _reshape_sizes(program)
    _renamed_and_identity_calls(program)
    program.graph_module.recompile()
    registry = registry_for(opset, table)
    decompositions = _decomp.create_onnx_friendly_decomposition_table(
        set(_decomp.get_onnx_implemented_overloads(registry))
    )
    needs = unsupported_calls(program, registry, decompositions)
    if needs:
        logger.debug("re-tracing for torch.onnx: %s", ", ".join(needs))
        return None
    graph_module = program.graph_module
    _fx_passes.insert_type_promotion_nodes(graph_module)
    program._graph_module = _fx_passes.remove_assertion_nodes(graph_module)
    onnx_program = _core._exported_program_to_onnx_program(program, registry=registry)
    # As torch.onnx.export does, whatever the opset: the conversion also drops the unused optional outputs
    # torchlib's translations declare (Attention's present key/value), which the `onnx` rules expect gone.
    onnx_program.model = onnxscript_apis.convert_version(onnx_program.model, opset)
    return onnx_program


def _export(program: torch.export.ExportedProgram, table: dict[Any, Any] | None, opset: int) -> Any:
    return torch.onnx.export(
        program,
        (),
        dynamo=True,
        custom_translation_table=table or None,
        opset_version=opset,
        optimize=False,
        verbose=False,
    )
