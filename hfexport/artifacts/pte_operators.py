"""The value kinds of an ExecuTorch program (`.pte`) and the kinds each operator it calls takes and writes.

`hfexport.artifacts.pte.check_program` checks every kernel call's arguments against these: the kinds come from the
operator's torch schema (ExecuTorch's own operator libraries registered on demand), from a table for the
`executorch_prim` operators without one, and for the operators that replace their result value (prim ops) the kind
they write from the kinds they read. Tag numbers follow `executorch/schema/program.fbs` (KernelTypes).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hfexport.artifacts.flatbuffer import Invalid, Table

# KernelTypes, the union of an EValue (program.fbs); 0 is flatbuffers' NONE.
NULL, INT, BOOL, DOUBLE, TENSOR, STRING, INT_LIST, DOUBLE_LIST, BOOL_LIST, TENSOR_LIST, OPTIONAL_TENSOR_LIST = range(
    1, 12
)
TAG_NAMES = {
    NULL: "None",
    INT: "int",
    BOOL: "bool",
    DOUBLE: "float",
    TENSOR: "Tensor",
    STRING: "str",
    INT_LIST: "int[]",
    DOUBLE_LIST: "float[]",
    BOOL_LIST: "bool[]",
    TENSOR_LIST: "Tensor[]",
    OPTIONAL_TENSOR_LIST: "Tensor?[]",
}
# scalar_type.fbs: the kinds `_local_scalar_dense` turns a tensor's first element into.
_SCALAR_KIND = {t: INT for t in (0, 1, 2, 3, 4, 27, 28, 29)} | {t: DOUBLE for t in (5, 6, 7, 15)} | {11: BOOL}
_MAX_OPERATOR_NAME = 99  # the runtime formats "name.overload" into a 100-byte buffer


def tag_name(tag: int) -> str:
    return TAG_NAMES.get(tag, f"unknown type {tag}")


@dataclass(frozen=True)
class Operator:
    name: str
    # allowed tags per argument (schema arguments, then returns); None: anything
    arguments: tuple[frozenset[int] | None, ...]
    # for operators that replace their result EValue (prim ops): the tag written, from the argument tags
    result: Callable[[list[int], list[int]], int | None] | None


def read_operator(op: Table, where: str) -> Operator:
    name = op.string(0, f"{where}: name")
    overload = op.string(1, f"{where}: overload") or ""
    if not name:
        raise Invalid(f"{where} has no name")
    if len((name + "." + overload).encode()) > _MAX_OPERATOR_NAME:
        raise Invalid(f"{where} has a name longer than the runtime's {_MAX_OPERATOR_NAME} bytes")
    full = f"{name}.{overload}" if overload else name
    arguments = _schema_arguments(name, overload)
    if arguments is None:
        raise Invalid(f"{where} is {full!r}, an operator whose arguments hfexport does not know (cannot be checked)")
    return Operator(full, arguments, _PRIM_RESULTS.get(full))


@functools.cache
def _schema_arguments(name: str, overload: str) -> tuple[frozenset[int] | None, ...] | None:
    if name in _PRIM_ARGUMENTS and overload == "int":
        return _PRIM_ARGUMENTS[name]
    if (name, overload) in _UNREGISTERED:
        return _UNREGISTERED[name, overload]
    schema = _schema(name, overload)
    if schema is None:
        return None
    arguments = tuple(_tags_of(a.type) for a in schema.arguments)
    outs = [a for a in schema.arguments if a.is_out]
    if outs:
        # executorch's emitter (`_emit_operator`) passes an out variant's result as one value whatever the schema
        # returns: its one out argument (also when the schema returns nothing: `split_with_sizes_copy.out`), or a
        # TensorList of its out arguments when there are several (`native_layer_norm.out`, `max.dim_max`).
        return (*arguments, _tags_of(outs[0].type) if len(outs) == 1 else frozenset({TENSOR_LIST}))
    return arguments + tuple(_tags_of(r.type) for r in schema.returns)


def _schema(name: str, overload: str) -> Any:
    import torch

    if "::" not in name or not name.replace("::", "").replace("_", "").isalnum():
        return None  # torch raises on names without a namespace; no operator has other characters
    for attempt in range(2):
        for schema in torch._C._jit_get_schemas_for_operator(name):
            if schema.overload_name == overload:
                return schema
        if attempt == 0:
            # ExecuTorch's own operator libraries (executorch_prim, dim_order_ops, ...) register with exir;
            # `llama::` (custom_sdpa) with its LLM custom ops.
            try:
                importlib.import_module("executorch.exir")
                if name.startswith("llama::"):
                    importlib.import_module("executorch.extension.llm.custom_ops.custom_ops")
            except ImportError:
                return None
    return None


def _tags_of(kind_type: Any) -> frozenset[int] | None:
    kind = kind_type.kind()
    if kind == "OptionalType":
        inner = _tags_of(kind_type.getElementType())
        return None if inner is None else inner | {NULL}
    if kind == "ListType":
        element = kind_type.getElementType()
        element_kind = element.kind()
        if element_kind == "OptionalType" and element.getElementType().kind() == "TensorType":
            return frozenset({OPTIONAL_TENSOR_LIST})
        listed = {"TensorType": TENSOR_LIST, "IntType": INT_LIST, "SymIntType": INT_LIST, "FloatType": DOUBLE_LIST}
        listed |= {"BoolType": BOOL_LIST}
        return frozenset({listed[element_kind]}) if element_kind in listed else None
    simple = {
        "TensorType": {TENSOR},
        "IntType": {INT},  # also ScalarType, Layout, MemoryFormat
        "SymIntType": {INT},
        "FloatType": {DOUBLE},
        "SymFloatType": {DOUBLE},
        "BoolType": {BOOL},
        "SymBoolType": {BOOL},
        "NumberType": {INT, DOUBLE, BOOL},  # Scalar
        "StringType": {STRING},
    }
    return frozenset(simple[kind]) if kind in simple else None


_T, _I, _IL = frozenset({TENSOR}), frozenset({INT}), frozenset({INT_LIST})
# executorch_prim operators without a torch schema (kernels/prim_ops/register_prim_ops.cpp).
_PRIM_ARGUMENTS = {"executorch_prim::floordiv": (_I, _I, _I), "executorch_prim::mod": (_I, _I, _I)}
_UNREGISTERED = {
    ("executorch_prim::et_copy_index", "tensor"): (_T, _T, _I),
    ("executorch_prim::et_view", "default"): (_T, _IL, _T),
}


def _numbers(kinds: Sequence[int], allowed: set[int]) -> bool:
    return all(kind in allowed for kind in kinds)


def _arith(tags: list[int], types: list[int]) -> int | None:
    a, b = tags[0], tags[1]
    if not _numbers((a, b), {INT, DOUBLE}):
        return None
    return INT if a == b == INT else DOUBLE


def _ints(tags: list[int], types: list[int]) -> int | None:
    return INT if tags[0] == tags[1] == INT else None


def _compare(tags: list[int], types: list[int]) -> int | None:
    a, b = tags[0], tags[1]
    return BOOL if _numbers((a, b), {INT, DOUBLE}) or a == b == BOOL else None


def _local_scalar(tags: list[int], types: list[int]) -> int | None:
    return _SCALAR_KIND.get(types[0]) if tags[0] == TENSOR else None


def _ite(tags: list[int], types: list[int]) -> int | None:
    return tags[1] if tags[0] == BOOL and tags[1] == tags[2] and tags[1] in (INT, DOUBLE, BOOL) else None


def _unary(result: int | None, accepted: set[int]) -> Callable[[list[int], list[int]], int | None]:
    return lambda tags, types: (tags[0] if result is None else result) if tags[0] in accepted else None


# Operators whose kernel replaces its result value (`out = EValue(...)`): the type it writes from the types
# of its arguments, None when the kernel would fail or abort on them. Every other kernel writes into tensors.
_PRIM_RESULTS: dict[str, Callable[[list[int], list[int]], int | None]] = {
    "aten::sym_size.int": lambda tags, types: INT if tags[0] == TENSOR else None,
    "aten::sym_numel": lambda tags, types: INT if tags[0] == TENSOR else None,
    "aten::_local_scalar_dense": _local_scalar,
    "executorch_prim::add.Scalar": _arith,
    "executorch_prim::sub.Scalar": _arith,
    "executorch_prim::mul.Scalar": _arith,
    "executorch_prim::floordiv.Scalar": _arith,
    "executorch_prim::truediv.Scalar": lambda tags, types: DOUBLE if _arith(tags, types) else None,
    "executorch_prim::sym_max.Scalar": _ints,
    "executorch_prim::sym_min.Scalar": _ints,
    "executorch_prim::mod.Scalar": _ints,
    "executorch_prim::floordiv.int": _ints,
    "executorch_prim::mod.int": _ints,
    "executorch_prim::sym_float.Scalar": _unary(DOUBLE, {INT, DOUBLE, BOOL}),
    "executorch_prim::sym_int.Scalar": _unary(INT, {INT, DOUBLE, BOOL}),
    "executorch_prim::ceil.Scalar": _unary(INT, {INT, DOUBLE}),
    "executorch_prim::round.Scalar": _unary(INT, {INT, DOUBLE}),
    "executorch_prim::trunc.Scalar": _unary(INT, {INT, DOUBLE}),
    "executorch_prim::neg.Scalar": _unary(None, {INT, DOUBLE}),
    "executorch_prim::sym_not.Scalar": _unary(BOOL, {BOOL}),
    "executorch_prim::eq.Scalar": _compare,
    "executorch_prim::gt.Scalar": _compare,
    "executorch_prim::lt.Scalar": _compare,
    "executorch_prim::ge.Scalar": _compare,
    "executorch_prim::le.Scalar": _compare,
    "executorch_prim::sym_ite.Scalar": _ite,
}
