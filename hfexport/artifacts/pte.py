"""A structural check of an ExecuTorch program (`.pte`) before the ExecuTorch runtime sees it.

The runtime verifies that the program's flatbuffer is well formed, and checks many indices, but it trusts the
program to be internally consistent in ways a damaged or hostile file need not be. Measured (tools/fuzz_pte.py,
tests/test_pte_structure.py): an input index past the values (an assertion that aborts the process), a kernel
argument of another type than the operator takes (`EValue::toTensor()` on an integer aborts), fewer arguments
than an XNNPACK graph binds (it indexes the argument list unchecked), a tensor with no storage written by a
kernel (a null pointer), an operator name that is not UTF-8 (the Python binding throws from its log sink and
terminates). `check_program` reads the flatbuffer with its own bounds-checked reader (no trust in any offset or
length) and refuses these, and the other inconsistencies of the same kinds (every value, list, tensor storage,
instruction and delegate reference; docs/reliability.md lists them), with `ArtifactError` before the runtime
sees the file. Field numbers follow `executorch/schema/program.fbs` for the file identifier `ET12`
(`hfexport.backends.executorch.artifact.check_pte` checks the identifier first; tests/test_pte_structure.py
compares the reader with ExecuTorch's own deserializer).
"""

from __future__ import annotations

import functools
import importlib
import os
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from hfexport.artifacts.errors import ArtifactError

# KernelTypes, the union of an EValue (program.fbs); 0 is flatbuffers' NONE.
NULL, INT, BOOL, DOUBLE, TENSOR, STRING, INT_LIST, DOUBLE_LIST, BOOL_LIST, TENSOR_LIST, OPTIONAL_TENSOR_LIST = range(
    1, 12
)
_TAG_NAMES = {
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
# InstructionArguments, the union of an Instruction.
KERNEL_CALL, DELEGATE_CALL, MOVE_CALL, JUMP_FALSE_CALL, FREE_CALL = range(1, 6)
# What a method can take or return (MethodMeta's get_tag): anything else fails in the runtime's bindings.
_IO_TAGS = frozenset({NULL, INT, BOOL, DOUBLE, TENSOR, STRING})
# scalar_type.fbs: element sizes in bytes; the kinds `_local_scalar_dense` turns a tensor's first element into.
_ELEMENT_SIZE = {0: 1, 1: 1, 2: 2, 3: 4, 4: 8, 5: 2, 6: 4, 7: 8, 11: 1, 12: 1, 13: 1, 14: 4, 15: 2, 16: 1, 17: 1}
_ELEMENT_SIZE |= {22: 2, 23: 1, 24: 1, 25: 1, 26: 1, 27: 2, 28: 4, 29: 8}
_SCALAR_KIND = {t: INT for t in (0, 1, 2, 3, 4, 27, 28, 29)} | {t: DOUBLE for t in (5, 6, 7, 15)} | {11: BOOL}
_MAX_RANK = 16  # kTensorDimensionLimit
_MAX_OPERATOR_NAME = 99  # the runtime formats "name.overload" into a 100-byte buffer
_XNNPACK = "XnnpackBackend"


class _Invalid(Exception):
    """A structural fault; `check_program` turns it into an `ArtifactError` naming the file."""


# Reads the check may make per byte of the program (plus a fixed allowance). A program's tables are each read a
# few times (a real program uses under 4 per byte: tools/fuzz_pte.py), but a flatbuffer may point many vector
# entries at one table (a plan's chains, a chain's instructions, values at one list): the check then visits that
# table once per reference, P*C*I visits for a few KB (an 8.6 KB file took more than 240 s). Charging every
# read bounds the check's time by the file's size whatever the sharing.
READS_PER_BYTE = 64
_READ_ALLOWANCE = 1 << 16
_READ_COST = 8  # per read, on top of its bytes: a read of a few bytes costs a Python call all the same


class _Reader:
    """Little-endian reads inside `data[:end]` that refuse any position outside it, and refuse to read more than
    `READS_PER_BYTE` times the program's size in all (shared tables read once per reference)."""

    def __init__(self, data: bytes | memoryview, end: int) -> None:
        self.data = data
        self.end = end
        self.budget = READS_PER_BYTE * end + _READ_ALLOWANCE
        self.spent = 0

    def need(self, pos: int, size: int, what: str) -> None:
        if pos < 0 or size < 0 or pos + size > self.end:
            raise _Invalid(f"{what} (bytes {pos}..{pos + size}) lies outside the program ({self.end} bytes)")
        self.spent += size + _READ_COST
        if self.spent > self.budget:
            raise _Invalid(
                f"reading it takes more than {READS_PER_BYTE} reads per byte of its {self.end} bytes: its tables are "
                "shared between many references (a program ExecuTorch writes reads each table a few times)"
            )

    def read(self, fmt: str, pos: int, what: str) -> Any:
        self.need(pos, struct.calcsize(fmt), what)
        return struct.unpack_from("<" + fmt, self.data, pos)[0]

    def root(self) -> _Table:
        return _Table(self, self.read("I", 0, "the root offset"), "the program")


class _Table:
    """A flatbuffer table: fields by slot number (a union takes two slots: its type, then its value)."""

    __slots__ = ("_len", "pos", "r", "vtable", "vtable_len", "what")

    def __init__(self, reader: _Reader, pos: int, what: str) -> None:
        self.r, self.pos, self.what = reader, pos, what
        self.vtable = pos - reader.read("i", pos, what)
        self.vtable_len = reader.read("H", self.vtable, f"the field table of {what}")
        self._len = reader.read("H", self.vtable + 2, f"the field table of {what}")
        if self.vtable_len < 4 or self.vtable_len % 2:
            raise _Invalid(f"the field table of {what} has a bad length {self.vtable_len}")
        reader.need(self.vtable, self.vtable_len, f"the field table of {what}")
        reader.need(pos, max(self._len, 4), what)

    def _field(self, slot: int, size: int) -> int:
        entry = 4 + 2 * slot
        if entry >= self.vtable_len:
            return 0
        offset = self.r.read("H", self.vtable + entry, self.what)
        if not offset:
            return 0
        if offset + size > self._len:
            raise _Invalid(f"a field of {self.what} lies past the end of its table")
        return self.pos + offset

    def scalar(self, slot: int, fmt: str, default: Any = 0) -> Any:
        at = self._field(slot, struct.calcsize(fmt))
        return self.r.read(fmt, at, self.what) if at else default

    def _ref(self, slot: int, what: str) -> int | None:
        at = self._field(slot, 4)
        return at + self.r.read("I", at, what) if at else None

    def table(self, slot: int, what: str) -> _Table | None:
        at = self._ref(slot, what)
        return _Table(self.r, at, what) if at is not None else None

    def length(self, slot: int, element_size: int, what: str) -> int | None:
        """The element count of a vector field (None when absent), its elements checked to lie in the program."""
        at = self._ref(slot, what)
        if at is None:
            return None
        count = self.r.read("I", at, what)
        self.r.need(at + 4, count * element_size, what)
        return count

    def vector(self, slot: int, fmt: str, what: str) -> list[Any] | None:
        at = self._ref(slot, what)
        if at is None:
            return None
        count = self.r.read("I", at, what)
        size = struct.calcsize(fmt)
        self.r.need(at + 4, count * size, what)
        return [item[0] for item in struct.iter_unpack("<" + fmt, self.r.data[at + 4 : at + 4 + count * size])]

    def tables(self, slot: int, what: str) -> list[_Table]:
        at = self._ref(slot, what)
        if at is None:
            return []
        count = self.r.read("I", at, what)
        self.r.need(at + 4, 4 * count, what)
        return [
            _Table(self.r, at + 4 + 4 * i + self.r.read("I", at + 4 + 4 * i, what), f"{what} {i}") for i in range(count)
        ]

    def string(self, slot: int, what: str) -> str | None:
        at = self._ref(slot, what)
        if at is None:
            return None
        count = self.r.read("I", at, what)
        self.r.need(at + 4, count + 1, what)
        raw = bytes(self.r.data[at + 4 : at + 4 + count])
        if self.r.data[at + 4 + count] != 0:
            raise _Invalid(f"{what} is not NUL-terminated")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise _Invalid(f"{what} is not UTF-8 text") from None


@dataclass(frozen=True)
class _Storage:
    """Where tensor bytes may lie: sizes of the planned buffers, constants and sub-segments."""

    planned: list[int]  # non_const_buffer_sizes; memory_id 0 is reserved
    constants: list[int]  # bytes available to constant i (constant_segment offsets, else constant_buffer)
    mutable: list[int]  # bytes available to mutable sub-segment i
    named: dict[str, int]  # named data: key -> segment size


def check_program(data: bytes, program_size: int, segment_base: int, name: str) -> list[str]:
    """Refuse (`ArtifactError`) an ExecuTorch program whose flatbuffer the runtime could not run safely; return
    the names of its methods (one execution plan each: `forward`, or a method per component of a generation
    artifact).

    `data` is the whole file, `program_size` the flatbuffer's length (the extended header's, else the file's),
    `segment_base` where the segments start (0 when there are none).
    """
    try:
        return _check(_Reader(data, program_size), len(data), segment_base)
    except _Invalid as exc:
        raise ArtifactError(f"{name!r} is not a consistent ExecuTorch program: {exc}") from None
    except (struct.error, IndexError, ValueError, OverflowError, RecursionError) as exc:  # defence in depth
        raise ArtifactError(f"{name!r} is not a readable ExecuTorch program: {type(exc).__name__}: {exc}") from None


def _check(r: _Reader, file_size: int, segment_base: int) -> list[str]:
    program = r.root()
    segments = []
    for seg in program.tables(4, "segment"):
        offset, size = seg.scalar(0, "Q"), seg.scalar(1, "Q")
        if not segment_base or segment_base + offset + size > file_size:
            raise _Invalid(f"segment {len(segments)} (offset {offset}, {size} bytes) lies outside the file")
        segments.append((segment_base + offset, size))
    storage = _storage(program, segments)
    delegate_data = [
        (blob.length(0, 1, "inline delegate data") or 0, blob) for blob in program.tables(3, "inline delegate data")
    ]
    plans = program.tables(1, "execution plan")
    if not plans:
        raise _Invalid("it has no execution plan")
    checked = [_check_plan(plan, storage, segments, delegate_data, r.data) for plan in plans]
    methods = [method for method, _ in checked]
    # A loaded artifact loads every method its components run, each with its own planned buffers.
    if sum(planned for _, planned in checked) > _physical_memory():
        raise _Invalid(f"its {len(methods)} methods plan more bytes of buffers than this machine's memory")
    return methods


def _storage(program: _Table, segments: list[tuple[int, int]]) -> _Storage:
    def sub_segment(table: _Table, what: str) -> list[int]:
        index = table.scalar(0, "I")
        offsets = table.vector(1, "Q", what) or []
        if not offsets:
            return []
        if index >= len(segments):
            raise _Invalid(f"{what} is in segment {index}, but the program has {len(segments)}")
        size = segments[index][1]
        if any(offset > size for offset in offsets):
            raise _Invalid(f"{what} has an offset past the end of its segment ({size} bytes)")
        return [size - offset for offset in offsets]

    constant_segment = program.table(5, "the constant segment")
    constants = sub_segment(constant_segment, "the constant segment") if constant_segment else []
    if not constants:  # the runtime reads constant_buffer when the constant segment lists no offsets
        constants = [buf.length(0, 1, "a constant buffer") or 0 for buf in program.tables(2, "constant buffer")]
    mutable = [sub_segment(t, "a mutable data segment") for t in program.tables(6, "mutable data segment")]
    named = {}
    for entry in program.tables(7, "named data"):
        key = entry.string(0, "a named data key")
        index = entry.scalar(1, "I")
        if key is None or index >= len(segments):
            raise _Invalid(f"named data {key!r} has no key or names segment {index} of {len(segments)}")
        named[key] = segments[index][1]
    return _Storage([], constants, mutable[0] if mutable else [], named)


def _check_plan(
    plan: _Table,
    storage: _Storage,
    segments: list[tuple[int, int]],
    delegate_data: list[tuple[int, _Table]],
    data: bytes,
) -> tuple[str, int]:
    """Check one execution plan (a method); return its name and the bytes of its planned buffers."""
    method = plan.string(0, "a method name")
    if method is None:
        raise _Invalid("an execution plan has no name")
    where = f"method {method!r}:"
    # container_meta_type (the pytree specs) and chain stack traces are never read by the runtime: not checked.
    planned = plan.vector(8, "q", "the planned buffer sizes") or []
    if any(size < 0 for size in planned):
        raise _Invalid(f"{where} a planned buffer has a negative size")
    # The runtime's Python binding allocates (and zero-fills) every planned buffer when the method loads: a
    # size beyond the machine's memory would not fail cleanly but get the process killed when it is touched.
    if sum(planned) > _physical_memory():
        raise _Invalid(f"{where} plans {sum(planned)} bytes of buffers, more than this machine's memory")
    for device in plan.tables(9, "a buffer device"):
        if not 0 <= device.scalar(0, "i") < len(planned) or device.scalar(1, "b") not in (0, 1):
            raise _Invalid(f"{where} a buffer device names a buffer or device that does not exist")
    storage = _Storage(planned, storage.constants, storage.mutable, storage.named)
    values = plan.tables(2, "value")
    tags = [value.scalar(0, "B") for value in values]
    n = len(values)
    inputs = plan.vector(3, "i", "the method inputs") or []
    outputs = plan.vector(4, "i", "the method outputs") or []
    for kind, indices in (("input", inputs), ("output", outputs)):
        for i, index in enumerate(indices):
            if not 0 <= index < n:
                raise _Invalid(f"{where} {kind} {i} is value {index}, but the method has {n} values")
            if tags[index] not in _IO_TAGS:
                raise _Invalid(
                    f"{where} {kind} {i} is a {_tag_name(tags[index])}, which a method cannot take or return"
                )
    external = set(inputs) | set(outputs)
    scalar_types: dict[int, int] = {}
    for i, value in enumerate(values):
        scalar_types[i] = _check_value(i, tags, value, storage, external, f"{where} value {i}")
    operators = [_operator(op, f"{where} operator {k}") for k, op in enumerate(plan.tables(6, "operator"))]
    delegates = [
        _delegate(d, segments, delegate_data, data, f"{where} delegate {k}")
        for k, d in enumerate(plan.tables(7, "delegate"))
    ]
    for c, chain in enumerate(plan.tables(5, "chain")):
        for kind, slot in (("input", 0), ("output", 1)):
            if any(not 0 <= index < n for index in chain.vector(slot, "i", f"chain {kind}s") or []):
                raise _Invalid(f"{where} chain {c} names an {kind} past the {n} values")
        instructions = chain.tables(2, "instruction")
        for k, instruction in enumerate(instructions):
            _check_instruction(
                instruction, len(instructions), tags, scalar_types, operators, delegates, f"{where} instruction {c}:{k}"
            )
    return method, sum(planned)


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not POSIX: no bound beyond the 64-bit one
        return 1 << 62


def _tag_name(tag: int) -> str:
    return _TAG_NAMES.get(tag, f"unknown type {tag}")


def _check_value(i: int, tags: list[int], value: _Table, storage: _Storage, external: set[int], where: str) -> int:
    """Check value `i`; return its scalar type when it is a tensor (else -1)."""
    tag = tags[i]
    n = len(tags)
    if tag not in _TAG_NAMES:
        raise _Invalid(f"{where} has {_tag_name(tag)}")
    payload = value.table(1, where)
    if payload is None:
        if tag == NULL:
            return -1
        raise _Invalid(f"{where} is a {_tag_name(tag)} without contents")
    if tag == TENSOR:
        return _check_tensor(i, payload, storage, external, where)
    if tag == STRING and payload.string(0, where) is None:
        raise _Invalid(f"{where} is a string without text")
    if tag in (INT_LIST, DOUBLE_LIST, BOOL_LIST, TENSOR_LIST, OPTIONAL_TENSOR_LIST):
        fmt = {INT_LIST: "q", DOUBLE_LIST: "d", BOOL_LIST: "B"}.get(tag, "i")
        items = payload.vector(0, fmt, where)
        if items is None:
            raise _Invalid(f"{where} is a list without items")
        for item in items if tag not in (DOUBLE_LIST, BOOL_LIST) else ():
            if tag == OPTIONAL_TENSOR_LIST and item == -1:
                continue
            # The runtime copies tensor list items while it parses, so they must come earlier; an int list
            # is read when a kernel runs, and every item must then be an int.
            limit = n if tag == INT_LIST else i
            wanted = {INT_LIST: {INT}, TENSOR_LIST: {TENSOR}, OPTIONAL_TENSOR_LIST: {TENSOR, NULL}}[tag]
            if not 0 <= item < limit or tags[item] not in wanted:
                found = _tag_name(tags[item]) if 0 <= item < n else "out of range"
                raise _Invalid(f"{where} ({_tag_name(tag)}) names value {item} ({found})")
    return -1


def _check_tensor(i: int, tensor: _Table, storage: _Storage, external: set[int], where: str) -> int:
    scalar_type = tensor.scalar(0, "b")
    if scalar_type not in _ELEMENT_SIZE:
        raise _Invalid(f"{where} has scalar type {scalar_type}, which ExecuTorch does not define")
    if tensor.scalar(1, "i") != 0:
        raise _Invalid(f"{where} has a storage offset (ExecuTorch supports none)")
    sizes = tensor.vector(2, "i", f"{where}: sizes")
    dim_order = tensor.vector(3, "B", f"{where}: dim order")
    if sizes is None or dim_order is None:
        raise _Invalid(f"{where} has no sizes or no dim order")
    if len(sizes) > _MAX_RANK or sorted(dim_order) != list(range(len(sizes))):
        raise _Invalid(f"{where} has sizes {sizes[:20]} and dim order {dim_order[:20]}: not a permutation of its axes")
    if any(size < 0 for size in sizes):
        raise _Invalid(f"{where} has a negative size {sizes}")
    if tensor.scalar(8, "b") not in (0, 1):  # STATIC, DYNAMIC_BOUND; DYNAMIC_UNBOUND is unsupported
        raise _Invalid(f"{where} has shape dynamism {tensor.scalar(8, 'b')}, which the runtime does not support")
    numel = 1
    for size in sizes:
        numel *= size
    nbytes = numel * _ELEMENT_SIZE[scalar_type]
    if nbytes >= 1 << 62:
        raise _Invalid(f"{where} of sizes {sizes} holds {nbytes} bytes")
    extra = tensor.table(9, f"{where}: extra info")
    allocation = tensor.table(6, f"{where}: allocation")
    buffer = tensor.scalar(5, "I")
    if extra is not None:
        if extra.scalar(3, "b") not in (0, 1):
            raise _Invalid(f"{where} is on device type {extra.scalar(3, 'b')}, which ExecuTorch does not define")
        fqn = extra.string(1, f"{where}: name")
        if extra.scalar(2, "b") != 0:  # data outside the program
            if allocation is not None:
                raise _Invalid(f"{where} reads its data from a separate .ptd file, which an hfexport artifact has not")
            if fqn is None or fqn not in storage.named:
                raise _Invalid(f"{where} reads named data {fqn!r}, which the program does not hold")
            if nbytes > storage.named[fqn]:
                raise _Invalid(f"{where} needs {nbytes} bytes; its named data {fqn!r} holds {storage.named[fqn]}")
            return scalar_type
    if allocation is not None:
        memory_id = allocation.scalar(0, "I")
        offset = allocation.scalar(1, "I") | allocation.scalar(2, "I") << 32
        if not 1 <= memory_id < len(storage.planned):
            raise _Invalid(f"{where} is planned in buffer {memory_id}, but the method plans {len(storage.planned) - 1}")
        if offset + nbytes > storage.planned[memory_id]:
            raise _Invalid(
                f"{where} ({nbytes} bytes at offset {offset}) lies past the end of planned buffer {memory_id} "
                f"({storage.planned[memory_id]} bytes)"
            )
        if buffer > 0 and (buffer >= len(storage.mutable) or nbytes > storage.mutable[buffer]):
            raise _Invalid(f"{where} starts from mutable data {buffer}, which is missing or smaller than the tensor")
    elif buffer > 0:
        if buffer >= len(storage.constants) or nbytes > storage.constants[buffer]:
            available = storage.constants[buffer] if buffer < len(storage.constants) else "no"
            raise _Invalid(f"{where} ({nbytes} bytes) reads constant {buffer}, which has {available} bytes")
    elif nbytes and i not in external:
        # No storage: only the caller's inputs and outputs get theirs at run time; a kernel would write to null.
        raise _Invalid(f"{where} ({nbytes} bytes) has no storage: neither planned, nor constant, nor an input/output")
    elif nbytes > _physical_memory():  # the binding allocates an unplanned output when the method loads
        raise _Invalid(f"{where} needs {nbytes} bytes, more than this machine's memory")
    return scalar_type


@dataclass(frozen=True)
class _Operator:
    name: str
    # allowed tags per argument (schema arguments, then returns); None: anything
    arguments: tuple[frozenset[int] | None, ...]
    # for operators that replace their result EValue (prim ops): the tag written, from the argument tags
    result: Callable[[list[int], list[int]], int | None] | None


def _operator(op: _Table, where: str) -> _Operator:
    name = op.string(0, f"{where}: name")
    overload = op.string(1, f"{where}: overload") or ""
    if not name:
        raise _Invalid(f"{where} has no name")
    if len((name + "." + overload).encode()) > _MAX_OPERATOR_NAME:
        raise _Invalid(f"{where} has a name longer than the runtime's {_MAX_OPERATOR_NAME} bytes")
    full = f"{name}.{overload}" if overload else name
    arguments = _schema_arguments(name, overload)
    if arguments is None:
        raise _Invalid(f"{where} is {full!r}, an operator whose arguments hfexport does not know (cannot be checked)")
    return _Operator(full, arguments, _PRIM_RESULTS.get(full))


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


@dataclass(frozen=True)
class _Delegate:
    # how many arguments the delegate's graph reads (XNNPACK: its external values); None when unknown
    arguments: int | None


def _delegate(
    delegate: _Table, segments: list[tuple[int, int]], inline: list[tuple[int, _Table]], data: bytes, where: str
) -> _Delegate:
    backend = delegate.string(0, f"{where}: backend id")
    processed = delegate.table(1, f"{where}: payload")
    for spec in delegate.tables(2, f"{where}: compile spec"):
        spec.string(0, "a compile spec key")
        spec.length(1, 1, "a compile spec value")
    if backend is None or processed is None:
        raise _Invalid(f"{where} has no backend id or no payload")
    location, index = processed.scalar(0, "b"), processed.scalar(1, "I")
    if location == 0:  # INLINE
        if index >= len(inline):
            raise _Invalid(f"{where} reads inline payload {index}, but the program holds {len(inline)}")
        return _Delegate(None)
    if location != 1 or index >= len(segments):
        raise _Invalid(f"{where} reads segment {index} (location {location}), but the program has {len(segments)}")
    if backend != _XNNPACK:
        return _Delegate(None)
    start, size = segments[index]
    return _Delegate(_xnnpack_externs(memoryview(data)[start : start + size], where))


def _xnnpack_externs(payload: memoryview, where: str) -> int:
    """The number of external values an XNNPACK payload's graph binds to the call's arguments (XNNHeader.h: magic
    "XH00" at 4, then u16 header length, u32 flatbuffer offset and size; XNNGraph field 3 is `num_externs`)."""
    if len(payload) < 18 or payload[4:8] != b"XH00":
        raise _Invalid(f"{where}: its XNNPACK payload has no XNNPACK header")
    offset, size = struct.unpack_from("<II", payload, 10)
    if offset + size > len(payload):
        raise _Invalid(f"{where}: its XNNPACK graph lies outside its payload")
    graph = _Reader(payload[offset : offset + size], size).root()
    return graph.scalar(3, "I")


def _check_instruction(
    instruction: _Table,
    count: int,
    tags: list[int],
    scalar_types: dict[int, int],
    operators: list[_Operator],
    delegates: list[_Delegate],
    where: str,
) -> None:
    kind = instruction.scalar(0, "B")
    call = instruction.table(1, where)
    if call is None or not KERNEL_CALL <= kind <= FREE_CALL:
        raise _Invalid(f"{where} is of unknown kind {kind}")
    n = len(tags)

    def value(index: int, what: str) -> int:
        if not 0 <= index < n:
            raise _Invalid(f"{where}: {what} is value {index}, but the method has {n}")
        return tags[index]

    if kind in (KERNEL_CALL, DELEGATE_CALL):
        target = call.scalar(0, "i")
        args = call.vector(1, "i", f"{where}: arguments")
        if args is None:
            raise _Invalid(f"{where} has no argument list")
        arg_tags = [value(a, f"argument {j}") for j, a in enumerate(args)]
        if kind == DELEGATE_CALL:
            if not 0 <= target < len(delegates):
                raise _Invalid(f"{where} calls delegate {target}, but the method has {len(delegates)}")
            externs = delegates[target].arguments
            if externs is not None and len(args) != externs:
                raise _Invalid(f"{where} passes {len(args)} arguments to a delegate graph that binds {externs}")
            if any(tag != TENSOR for tag in arg_tags):
                raise _Invalid(f"{where} passes a non-tensor to a delegate")
            return
        if not 0 <= target < len(operators):
            raise _Invalid(f"{where} calls operator {target}, but the method has {len(operators)}")
        op = operators[target]
        if len(args) != len(op.arguments):
            raise _Invalid(f"{where} passes {len(args)} arguments to {op.name}, which takes {len(op.arguments)}")
        if op.result is not None:
            written = op.result(arg_tags[:-1], [scalar_types.get(a, -1) for a in args[:-1]])
            if written in (DOUBLE, BOOL) and arg_tags[-1] == INT and op.name.startswith("executorch_prim::"):
                # executorch's emitter serialises the result of every `executorch_prim` op (schema return
                # `Scalar`) as an `Int(0)` placeholder, "the runtime operator just overrides the EValue
                # completely" (`exir/emit/_emitter.py`): `truediv.Scalar` writes a double there (yolos' position
                # grid scale). Later instructions read the type it writes.
                tags[args[-1]] = written
            elif written is None or written != arg_tags[-1]:
                raise _Invalid(
                    f"{where}: {op.name} on {[_tag_name(t) for t in arg_tags[:-1]]} writes "
                    f"{_tag_name(written) if written else 'nothing valid'} into a {_tag_name(arg_tags[-1])}"
                )
            allowed: Sequence[frozenset[int] | None] = op.arguments[:-1]
        else:
            allowed = op.arguments
        for j, (tag, wanted) in enumerate(zip(arg_tags, allowed, strict=False)):
            if wanted is not None and tag not in wanted:
                names = "/".join(sorted(_tag_name(t) for t in wanted))
                raise _Invalid(f"{where}: argument {j} of {op.name} is a {_tag_name(tag)}, it takes {names}")
    elif kind == MOVE_CALL:
        source, target = value(call.scalar(0, "i"), "the move source"), value(call.scalar(1, "i"), "the move target")
        if source != target:
            raise _Invalid(f"{where} moves a {_tag_name(source)} into a {_tag_name(target)}")
    elif kind == JUMP_FALSE_CALL:
        if value(call.scalar(0, "i"), "the condition") not in (TENSOR, BOOL):
            raise _Invalid(f"{where} jumps on a value that is neither a tensor nor a bool")
        if not 0 <= call.scalar(1, "i") <= count:
            raise _Invalid(f"{where} jumps to instruction {call.scalar(1, 'i')} of {count}")
    elif value(call.scalar(0, "i"), "the freed value") != TENSOR:
        raise _Invalid(f"{where} frees a value that is not a tensor")
