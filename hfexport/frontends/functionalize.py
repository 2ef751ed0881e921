"""Functionalise a program's direct writes into its inputs without re-tracing it.

A static cache's update (`index_copy_` into the key/value inputs, `add_` into the cumulative length) stays
in-place in `torch.export.export`'s graph. The Dynamo artifact documents each such write as a
`USER_INPUT_MUTATION` output, which `run_decompositions({})` produces by tracing the whole program again: as
long as the first trace on a decoder (11 s of a 4-layer SmolLM2-shaped export's 30 s, 2026-12-02). When every
write is an in-place ATen op on a user input itself (not a view of one), the same form is a local edit: each
write becomes its functional op, later reads of the input read its result, and the last result of each input is
returned as that input's mutation. Anything else (a write through a view, into a buffer, an `out=` argument)
keeps the re-trace.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    OutputKind,
    OutputSpec,
    TensorArgument,
)


def _functional(node: torch.fx.Node) -> Any:
    """The functional overload of an in-place ATen call (`index_copy_.default` -> `index_copy.default`), or None."""
    target = node.target
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "aten":
        return None
    name = target._schema.name.split("::")[-1]
    if not name.endswith("_") or name.startswith("_"):
        return None
    packet = getattr(torch.ops.aten, name[:-1], None)
    overload = getattr(packet, target._overloadname, None)
    if overload is None or overload._schema.is_mutable:
        return None
    written = [a for a in target._schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    same_arguments = [a.name for a in overload._schema.arguments] == [a.name for a in target._schema.arguments]
    return overload if same_arguments and [a.name for a in written] == ["self"] else None


def _input_writes(program: torch.export.ExportedProgram) -> dict[torch.fx.Node, tuple[torch.fx.Node, Any]] | None:
    """{write: (the user input it writes, its functional overload)} if every write is an in-place op with a
    functional overload on a user input placeholder (or on an earlier such write's result, which aliases it); None
    if any write is another kind (or the program already has mutation outputs)."""
    signature = program.graph_signature
    if any(spec.kind != OutputKind.USER_OUTPUT for spec in signature.output_specs):
        return None
    user_inputs = {
        spec.arg.name for spec in signature.input_specs if spec.kind == InputKind.USER_INPUT and spec.arg is not None
    }
    writes: dict[torch.fx.Node, tuple[torch.fx.Node, Any]] = {}
    for node in program.graph.nodes:
        schema = getattr(node.target, "_schema", None)
        if node.op != "call_function" or schema is None or not schema.is_mutable:
            continue
        written = node.args[0] if node.args else None
        if isinstance(written, torch.fx.Node) and written.op == "placeholder" and written.name in user_inputs:
            root = written
        else:
            root = writes[written][0] if written in writes else None
        functional = _functional(node)
        if functional is None or root is None or "self" in node.kwargs:
            return None
        writes[node] = root, functional
    return writes


def functionalize_input_writes(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram | None:
    """`program` with its writes into user inputs as functional ops plus `USER_INPUT_MUTATION` outputs, edited in
    place of a re-trace; None (program unchanged) where a write is not of that simple form."""
    writes = _input_writes(program)
    if not writes:
        return None
    graph = program.graph_module.graph
    latest: dict[torch.fx.Node, torch.fx.Node] = {}  # input placeholder -> its value after the last write so far
    for node in list(graph.nodes):
        if node.op == "placeholder":
            continue
        for source, value in latest.items():
            if source in node.all_input_nodes:
                node.replace_input_with(source, value)
        if node.op == "output":
            break
        if node in writes:
            written, functional = writes[node]
            with graph.inserting_after(node):
                result = graph.call_function(functional, tuple(node.args), dict(node.kwargs))
            result.meta = dict(node.meta)
            node.replace_all_uses_with(result)
            graph.erase_node(node)
            latest[written] = result
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    mutated = [source for source in graph.nodes if source in latest]  # placeholder order
    user_outputs = output.args[0]
    output.args = ((*[latest[source] for source in mutated], *user_outputs),)
    signature = program.graph_signature
    output_specs = [
        OutputSpec(kind=OutputKind.USER_INPUT_MUTATION, arg=TensorArgument(name=latest[s].name), target=s.name)
        for s in mutated
    ]
    # A user output that returned an input (a cache returned as it was written) now names its written value.
    for spec, value in zip(signature.output_specs, user_outputs, strict=True):
        if isinstance(spec.arg, TensorArgument) and isinstance(value, torch.fx.Node):
            spec = OutputSpec(kind=spec.kind, arg=TensorArgument(name=value.name), target=spec.target)
        output_specs.append(spec)
    graph.lint()
    program.graph_module.recompile()
    return torch.export.ExportedProgram(
        root=program.graph_module,
        graph=graph,
        graph_signature=ExportGraphSignature(input_specs=list(signature.input_specs), output_specs=output_specs),
        state_dict=program.state_dict,
        range_constraints=program.range_constraints,
        module_call_graph=program.module_call_graph,
        example_inputs=program.example_inputs,
        constants=program.constants,
        verifiers=[program.verifier],
    )
