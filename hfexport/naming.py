"""The naming contract of exported programs: how inputs and outputs are named, and feeds built from kwargs.

Every graph input and output is named after its place in the forward kwargs or the model output
(`input_ids`, `logits`, `cache.layers_0_keys`). A name that is both an input and an output (a cache the
graph updates) becomes `input.<name>` / `output.<name>`, so a runtime can bind the pair to one buffer.
Every lowering, runtime, quantizer and the artifact code read names through this module, so the rule is
written once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

from hfexport.core.cache_pytree import register_cache_pytrees

INPUT_PREFIX = "input."
OUTPUT_PREFIX = "output."
IN_PLACE_PREFIXES = (INPUT_PREFIX, OUTPUT_PREFIX)


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_name(path: tuple[Any, ...]) -> str:
    """The dotted name of one pytree key path: `cache.layers_0_keys`, `encoder_outputs.0`."""
    return ".".join(_key_name(k) for k in path)


def leaf_names(tree: Any) -> list[tuple[str, Any]]:
    """`(dotted name, leaf)` for every pytree leaf of `tree`: `cache.layers_0_keys`, `logits`, ..."""
    leaves, _ = pytree.tree_flatten_with_path(tree)
    return [(path_name(path), leaf) for path, leaf in leaves]


def tensor_leaves(tree: Any) -> dict[str, torch.Tensor]:
    """Tensor leaves of forward kwargs or a model output by flat name (caches flattened to their tensors)."""
    register_cache_pytrees()
    return {name: leaf for name, leaf in leaf_names(tree) if isinstance(leaf, torch.Tensor)}


def named_outputs(outputs: Any) -> dict[str, torch.Tensor]:
    """Tensor leaves of a model output tree by flat name (`logits`, `cache.layers_0_keys`), detached."""
    return {name: leaf.detach() for name, leaf in tensor_leaves(outputs).items()}


def plain_name(name: str) -> str:
    """A name without the `input.`/`output.` prefix of an in-place cache pair."""
    for prefix in IN_PLACE_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


# Recurrent states that are not a transformers `Cache` but a list of tensors, which generate still carries from
# one step's output to the next step's kwarg of the same name (transformers 5.24 generation/utils.py
# `DEPRECATED_CACHE_NAMES`: RWKV's `state`, XLNet's `mems`, Reformer's `past_buckets_states`).
STATE_CACHE_NAMES = ("state", "mems", "past_buckets_states")
# Names a forward gives its cache, as input and as output: transformers 5.24 returns `cache` for the cache a
# generation graph takes as `past_key_values`, older state-space models `cache_params`, RWKV `state`.
CACHE_ALIASES = ("past_key_values", "cache", "cache_params", *STATE_CACHE_NAMES)


def _as_cache_input(name: str, inputs: set[str]) -> str:
    """An output leaf of a returned cache named like the cache input leaf it updates (`cache.x` ->
    `past_key_values.x` when that is the input), so the pair is found whatever the forward calls its cache."""
    head, dot, rest = name.partition(".")
    if not dot or head not in CACHE_ALIASES or name in inputs:
        return name
    return next((f"{a}.{rest}" for a in CACHE_ALIASES if f"{a}.{rest}" in inputs), name)


def paired_names(input_names: list[str], output_names: list[str]) -> tuple[list[str], list[str]]:
    """Input and output names with the in-place prefixes on every name that is both (a returned cache is
    named after the cache input it updates)."""
    given = set(input_names)
    output_names = [_as_cache_input(n, given) for n in output_names]
    shared = given & set(output_names)
    inputs = [INPUT_PREFIX + n if n in shared else n for n in input_names]
    outputs = [OUTPUT_PREFIX + n if n in shared else n for n in output_names]
    return inputs, outputs


def spec_names(spec: pytree.TreeSpec, drop_first: bool) -> list[str]:
    """Leaf names of a program's in/out spec; `drop_first` for an in_spec `((args), {kwargs})`."""
    # Tensor placeholders: a cache pytree re-flattens only its tensors as leaves (ints are context).
    dummy = pytree.tree_unflatten([torch.empty(0) for _ in range(spec.num_leaves)], spec)
    if drop_first:  # the forward is called with kwargs only
        dummy = {"": dummy[0], **dummy[1]} if dummy[0] else dummy[1]
    # A bare tensor (an lm_head's output) has the empty path; a graph value needs a name.
    return [name or "output" for name, _ in leaf_names(dummy)]


def user_input_names(program: torch.export.ExportedProgram, tensors_only: bool = False) -> list[str] | None:
    """Names of the program's user inputs that a lowering keeps, in order; None when they cannot be mapped.

    Constant inputs (`use_cache=True`) are dropped by every lowering; `tensors_only` also drops SymInt inputs,
    as `openvino.convert_model` does.
    """
    from torch.export.graph_signature import ConstantArgument, InputKind, TensorArgument

    register_cache_pytrees()
    names = spec_names(program.call_spec.in_spec, drop_first=True)
    specs = [s for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    if len(specs) != len(names):
        return None
    if tensors_only:
        return [n for n, s in zip(names, specs, strict=True) if isinstance(s.arg, TensorArgument)]
    return [n for n, s in zip(names, specs, strict=True) if not isinstance(s.arg, ConstantArgument)]


def user_output_names(program: torch.export.ExportedProgram) -> list[str] | None:
    """Names of the program's non-constant user outputs, in order; None when they cannot be mapped."""
    from torch.export.graph_signature import ConstantArgument, OutputKind

    register_cache_pytrees()
    names = spec_names(program.call_spec.out_spec, drop_first=False)
    specs = [s for s in program.graph_signature.output_specs if s.kind == OutputKind.USER_OUTPUT]
    if len(specs) != len(names):
        return None
    return [n for n, s in zip(names, specs, strict=True) if not isinstance(s.arg, ConstantArgument)]


def signature_names(program: torch.export.ExportedProgram) -> tuple[list[str], list[str]] | None:
    """Names of the program's tensor user inputs and outputs, in order, or None when they cannot be mapped.

    Lowerings keep; `openvino.convert_model` keeps one model input per tensor user input and one output per tensor user
    output (constants such as `use_cache=True` are folded in), in the program's flattened order.
    """
    if program.call_spec.in_spec is None or program.call_spec.out_spec is None:
        return None
    in_names = user_input_names(program, tensors_only=True)
    out_names = user_output_names(program)
    if in_names is None or out_names is None:
        return None
    return in_names, out_names


def manager_input_names(manager: Any, method: str = "forward") -> list[str] | None:
    """The forward kwarg names, in the program's order, of an `ExecutorchProgramManager`'s method."""
    try:
        spec = manager.exported_program(method).call_spec.in_spec
        kwargs_spec = spec.child(1) if hasattr(spec, "child") else spec.children_specs[1]
        return [str(name) for name in kwargs_spec.context]
    except (AttributeError, IndexError, KeyError, TypeError):
        return None


def feed_by_name(graph_input_names: list[str], inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Numpy arrays by graph input name for forward kwargs `inputs` (ONNX Runtime and OpenVINO feeds).

    A missing input raises `KeyError` naming it and the inputs that exist.
    """
    flat = tensor_leaves(dict(inputs))
    feed = {}
    for graph_name in graph_input_names:
        name = graph_name.removeprefix(INPUT_PREFIX)
        if name not in flat:
            raise KeyError(f"graph input {graph_name!r} has no matching sample input; inputs: {sorted(flat)}")
        feed[graph_name] = flat[name].detach().cpu().numpy()
    return feed


def onnx_feed(input_names: list[str], sample_inputs: Mapping[str, Any]) -> dict[str, Any]:
    """The ONNX Runtime feed (numpy arrays by graph input name) for forward kwargs `sample_inputs`."""
    return feed_by_name(input_names, sample_inputs)


def openvino_feed(inputs: Mapping[str, Any], model: Any = None) -> dict[str, Any]:
    """Numpy arrays by OpenVINO input name for forward kwargs `inputs` (tensors, caches; constants dropped).

    With `model` (an `openvino.Model` or `CompiledModel`), the feed holds exactly its inputs, in its order,
    and a missing input raises `KeyError`; without it, every tensor leaf of `inputs` by its flat name.
    """
    if model is None:
        return {name: t.detach().cpu().numpy() for name, t in tensor_leaves(dict(inputs)).items()}
    return feed_by_name([port.get_any_name() for port in model.inputs], inputs)


def executorch_named_feed(inputs: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """`(name, value)` for each ExecuTorch method input of forward kwargs `inputs`, in the program's order.

    Python constants (`use_cache=False`, None) stay in place: ExecuTorch keeps them as method inputs.
    """
    register_cache_pytrees()
    leaves, _ = pytree.tree_flatten_with_path(dict(inputs))
    return [(path_name(path), leaf.detach() if isinstance(leaf, torch.Tensor) else leaf) for path, leaf in leaves]


def canonical_output(output: Any) -> Any:
    """A ModelOutput with its fields in declaration order.

    `get_image_features` fills `pooler_output` after construction (`outputs.pooler_output = ...`), which appends
    the key; transformers 5.24 flattens a ModelOutput's values in insertion order but names them in declaration
    order, so an exported graph would return the fields under each other's names.
    """
    import dataclasses

    from transformers.utils import ModelOutput

    if not isinstance(output, ModelOutput) or not dataclasses.is_dataclass(output):
        return output
    ordered = {f.name: output[f.name] for f in dataclasses.fields(output) if f.name in output}
    return type(output)(**ordered)


def variable_leaf(variable_id: str) -> str | None:
    """The cache leaf (`past_key_values.layers_0_keys`) of an OpenVINO variable made from the pair `input.<leaf>` /
    `output.<leaf>` (its id is the two names joined, as OpenVINO's MakeStateful names it), or None."""
    if not variable_id.startswith(INPUT_PREFIX):
        return None
    for cut in range(len(INPUT_PREFIX), len(variable_id)):
        leaf = variable_id[len(INPUT_PREFIX) : cut]
        if variable_id[cut:] == OUTPUT_PREFIX + leaf:
            return leaf
    return None
