"""A structural check of an ExecuTorch program (`.pte`) before the ExecuTorch runtime sees it.

The runtime verifies that the program's flatbuffer is well formed, and checks many indices, but it trusts the
program to be internally consistent in ways a damaged or hostile file need not be. Measured (tools/fuzz_pte.py,
tests/test_pte_structure.py): an input index past the values (an assertion that aborts the process), a kernel
argument of another type than the operator takes (`EValue::toTensor()` on an integer aborts), fewer arguments
than an XNNPACK graph binds (it indexes the argument list unchecked), a tensor with no storage written by a
kernel (a null pointer), an operator name that is not UTF-8 (the Python binding throws from its log sink and
terminates). `check_program` reads the flatbuffer with a bounds-checked reader (`flatbuffer.py`: no trust in
any offset or length) and refuses these, and the other inconsistencies of the same kinds (every value, list,
tensor storage, instruction and delegate reference; docs/reliability.md lists them), with `ArtifactError` before
the runtime sees the file. Field numbers follow `executorch/schema/program.fbs` for the file identifier `ET12`
(`hfexport.backends.executorch.artifact.check_pte` checks the identifier first; tests/test_pte_structure.py
compares the reader with ExecuTorch's own deserializer).
"""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from hfexport.artifacts.errors import ArtifactError
from hfexport.artifacts.flatbuffer import Invalid, Reader, Table
from hfexport.artifacts.pte_operators import (
    BOOL,
    BOOL_LIST,
    DOUBLE,
    DOUBLE_LIST,
    INT,
    INT_LIST,
    NULL,
    OPTIONAL_TENSOR_LIST,
    STRING,
    TAG_NAMES,
    TENSOR,
    TENSOR_LIST,
    Operator,
    read_operator,
    tag_name,
)

# InstructionArguments, the union of an Instruction.
KERNEL_CALL, DELEGATE_CALL, MOVE_CALL, JUMP_FALSE_CALL, FREE_CALL = range(1, 6)
# What a method can take or return (MethodMeta's get_tag): anything else fails in the runtime's bindings.
_IO_TAGS = frozenset({NULL, INT, BOOL, DOUBLE, TENSOR, STRING})
# scalar_type.fbs: element sizes in bytes.
_ELEMENT_SIZE = {0: 1, 1: 1, 2: 2, 3: 4, 4: 8, 5: 2, 6: 4, 7: 8, 11: 1, 12: 1, 13: 1, 14: 4, 15: 2, 16: 1, 17: 1}
_ELEMENT_SIZE |= {22: 2, 23: 1, 24: 1, 25: 1, 26: 1, 27: 2, 28: 4, 29: 8}
_MAX_RANK = 16  # kTensorDimensionLimit
_XNNPACK = "XnnpackBackend"


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
        return _check(Reader(data, program_size), len(data), segment_base)
    except Invalid as exc:
        raise ArtifactError(f"{name!r} is not a consistent ExecuTorch program: {exc}") from None
    except (struct.error, IndexError, ValueError, OverflowError, RecursionError) as exc:  # defence in depth
        raise ArtifactError(f"{name!r} is not a readable ExecuTorch program: {type(exc).__name__}: {exc}") from None


def _check(r: Reader, file_size: int, segment_base: int) -> list[str]:
    program = r.root()
    segments = []
    for seg in program.tables(4, "segment"):
        offset, size = seg.scalar(0, "Q"), seg.scalar(1, "Q")
        if not segment_base or segment_base + offset + size > file_size:
            raise Invalid(f"segment {len(segments)} (offset {offset}, {size} bytes) lies outside the file")
        segments.append((segment_base + offset, size))
    storage = _storage(program, segments)
    delegate_data = [
        (blob.length(0, 1, "inline delegate data") or 0, blob) for blob in program.tables(3, "inline delegate data")
    ]
    plans = program.tables(1, "execution plan")
    if not plans:
        raise Invalid("it has no execution plan")
    checked = [_check_plan(plan, storage, segments, delegate_data, r.data) for plan in plans]
    methods = [method for method, _ in checked]
    # A loaded artifact loads every method its components run, each with its own planned buffers.
    if sum(planned for _, planned in checked) > _physical_memory():
        raise Invalid(f"its {len(methods)} methods plan more bytes of buffers than this machine's memory")
    return methods


def _storage(program: Table, segments: list[tuple[int, int]]) -> _Storage:
    def sub_segment(table: Table, what: str) -> list[int]:
        index = table.scalar(0, "I")
        offsets = table.vector(1, "Q", what) or []
        if not offsets:
            return []
        if index >= len(segments):
            raise Invalid(f"{what} is in segment {index}, but the program has {len(segments)}")
        size = segments[index][1]
        if any(offset > size for offset in offsets):
            raise Invalid(f"{what} has an offset past the end of its segment ({size} bytes)")
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
            raise Invalid(f"named data {key!r} has no key or names segment {index} of {len(segments)}")
        named[key] = segments[index][1]
    return _Storage([], constants, mutable[0] if mutable else [], named)


def _check_plan(
    plan: Table,
    storage: _Storage,
    segments: list[tuple[int, int]],
    delegate_data: list[tuple[int, Table]],
    data: bytes,
) -> tuple[str, int]:
    """Check one execution plan (a method); return its name and the bytes of its planned buffers."""
    method = plan.string(0, "a method name")
    if method is None:
        raise Invalid("an execution plan has no name")
    where = f"method {method!r}:"
    # container_meta_type (the pytree specs) and chain stack traces are never read by the runtime: not checked.
    planned = plan.vector(8, "q", "the planned buffer sizes") or []
    if any(size < 0 for size in planned):
        raise Invalid(f"{where} a planned buffer has a negative size")
    # The runtime's Python binding allocates (and zero-fills) every planned buffer when the method loads: a
    # size beyond the machine's memory would not fail cleanly but get the process killed when it is touched.
    if sum(planned) > _physical_memory():
        raise Invalid(f"{where} plans {sum(planned)} bytes of buffers, more than this machine's memory")
    for device in plan.tables(9, "a buffer device"):
        if not 0 <= device.scalar(0, "i") < len(planned) or device.scalar(1, "b") not in (0, 1):
            raise Invalid(f"{where} a buffer device names a buffer or device that does not exist")
    storage = _Storage(planned, storage.constants, storage.mutable, storage.named)
    values = plan.tables(2, "value")
    tags = [value.scalar(0, "B") for value in values]
    n = len(values)
    inputs = plan.vector(3, "i", "the method inputs") or []
    outputs = plan.vector(4, "i", "the method outputs") or []
    for kind, indices in (("input", inputs), ("output", outputs)):
        for i, index in enumerate(indices):
            if not 0 <= index < n:
                raise Invalid(f"{where} {kind} {i} is value {index}, but the method has {n} values")
            if tags[index] not in _IO_TAGS:
                raise Invalid(f"{where} {kind} {i} is a {tag_name(tags[index])}, which a method cannot take or return")
    external = set(inputs) | set(outputs)
    scalar_types: dict[int, int] = {}
    for i, value in enumerate(values):
        scalar_types[i] = _check_value(i, tags, value, storage, external, f"{where} value {i}")
    operators = [read_operator(op, f"{where} operator {k}") for k, op in enumerate(plan.tables(6, "operator"))]
    delegates = [
        _delegate(d, segments, delegate_data, data, f"{where} delegate {k}")
        for k, d in enumerate(plan.tables(7, "delegate"))
    ]
    for c, chain in enumerate(plan.tables(5, "chain")):
        for kind, slot in (("input", 0), ("output", 1)):
            if any(not 0 <= index < n for index in chain.vector(slot, "i", f"chain {kind}s") or []):
                raise Invalid(f"{where} chain {c} names an {kind} past the {n} values")
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


def _check_value(i: int, tags: list[int], value: Table, storage: _Storage, external: set[int], where: str) -> int:
    """Check value `i`; return its scalar type when it is a tensor (else -1)."""
    tag = tags[i]
    n = len(tags)
    if tag not in TAG_NAMES:
        raise Invalid(f"{where} has {tag_name(tag)}")
    payload = value.table(1, where)
    if payload is None:
        if tag == NULL:
            return -1
        raise Invalid(f"{where} is a {tag_name(tag)} without contents")
    if tag == TENSOR:
        return _check_tensor(i, payload, storage, external, where)
    if tag == STRING and payload.string(0, where) is None:
        raise Invalid(f"{where} is a string without text")
    if tag in (INT_LIST, DOUBLE_LIST, BOOL_LIST, TENSOR_LIST, OPTIONAL_TENSOR_LIST):
        fmt = {INT_LIST: "q", DOUBLE_LIST: "d", BOOL_LIST: "B"}.get(tag, "i")
        items = payload.vector(0, fmt, where)
        if items is None:
            raise Invalid(f"{where} is a list without items")
        for item in items if tag not in (DOUBLE_LIST, BOOL_LIST) else ():
            if tag == OPTIONAL_TENSOR_LIST and item == -1:
                continue
            # The runtime copies tensor list items while it parses, so they must come earlier; an int list
            # is read when a kernel runs, and every item must then be an int.
            limit = n if tag == INT_LIST else i
            wanted = {INT_LIST: {INT}, TENSOR_LIST: {TENSOR}, OPTIONAL_TENSOR_LIST: {TENSOR, NULL}}[tag]
            if not 0 <= item < limit or tags[item] not in wanted:
                found = tag_name(tags[item]) if 0 <= item < n else "out of range"
                raise Invalid(f"{where} ({tag_name(tag)}) names value {item} ({found})")
    return -1


def _check_tensor(i: int, tensor: Table, storage: _Storage, external: set[int], where: str) -> int:
    scalar_type = tensor.scalar(0, "b")
    if scalar_type not in _ELEMENT_SIZE:
        raise Invalid(f"{where} has scalar type {scalar_type}, which ExecuTorch does not define")
    if tensor.scalar(1, "i") != 0:
        raise Invalid(f"{where} has a storage offset (ExecuTorch supports none)")
    sizes = tensor.vector(2, "i", f"{where}: sizes")
    dim_order = tensor.vector(3, "B", f"{where}: dim order")
    if sizes is None or dim_order is None:
        raise Invalid(f"{where} has no sizes or no dim order")
    if len(sizes) > _MAX_RANK or sorted(dim_order) != list(range(len(sizes))):
        raise Invalid(f"{where} has sizes {sizes[:20]} and dim order {dim_order[:20]}: not a permutation of its axes")
    if any(size < 0 for size in sizes):
        raise Invalid(f"{where} has a negative size {sizes}")
    if tensor.scalar(8, "b") not in (0, 1):  # STATIC, DYNAMIC_BOUND; DYNAMIC_UNBOUND is unsupported
        raise Invalid(f"{where} has shape dynamism {tensor.scalar(8, 'b')}, which the runtime does not support")
    numel = 1
    for size in sizes:
        numel *= size
    nbytes = numel * _ELEMENT_SIZE[scalar_type]
    if nbytes >= 1 << 62:
        raise Invalid(f"{where} of sizes {sizes} holds {nbytes} bytes")
    extra = tensor.table(9, f"{where}: extra info")
    allocation = tensor.table(6, f"{where}: allocation")
    buffer = tensor.scalar(5, "I")
    if extra is not None:
        if extra.scalar(3, "b") not in (0, 1):
            raise Invalid(f"{where} is on device type {extra.scalar(3, 'b')}, which ExecuTorch does not define")
        fqn = extra.string(1, f"{where}: name")
        if extra.scalar(2, "b") != 0:  # data outside the program
            if allocation is not None:
                raise Invalid(f"{where} reads its data from a separate .ptd file, which an hfexport artifact has not")
            if fqn is None or fqn not in storage.named:
                raise Invalid(f"{where} reads named data {fqn!r}, which the program does not hold")
            if nbytes > storage.named[fqn]:
                raise Invalid(f"{where} needs {nbytes} bytes; its named data {fqn!r} holds {storage.named[fqn]}")
            return scalar_type
    if allocation is not None:
        memory_id = allocation.scalar(0, "I")
        offset = allocation.scalar(1, "I") | allocation.scalar(2, "I") << 32
        if not 1 <= memory_id < len(storage.planned):
            raise Invalid(f"{where} is planned in buffer {memory_id}, but the method plans {len(storage.planned) - 1}")
        if offset + nbytes > storage.planned[memory_id]:
            raise Invalid(
                f"{where} ({nbytes} bytes at offset {offset}) lies past the end of planned buffer {memory_id} "
                f"({storage.planned[memory_id]} bytes)"
            )
        if buffer > 0 and (buffer >= len(storage.mutable) or nbytes > storage.mutable[buffer]):
            raise Invalid(f"{where} starts from mutable data {buffer}, which is missing or smaller than the tensor")
    elif buffer > 0:
        if buffer >= len(storage.constants) or nbytes > storage.constants[buffer]:
            available = storage.constants[buffer] if buffer < len(storage.constants) else "no"
            raise Invalid(f"{where} ({nbytes} bytes) reads constant {buffer}, which has {available} bytes")
    elif nbytes and i not in external:
        # No storage: only the caller's inputs and outputs get theirs at run time; a kernel would write to null.
        raise Invalid(f"{where} ({nbytes} bytes) has no storage: neither planned, nor constant, nor an input/output")
    elif nbytes > _physical_memory():  # the binding allocates an unplanned output when the method loads
        raise Invalid(f"{where} needs {nbytes} bytes, more than this machine's memory")
    return scalar_type


@dataclass(frozen=True)
class _Delegate:
    # how many arguments the delegate's graph reads (XNNPACK: its external values); None when unknown
    arguments: int | None


def _delegate(
    delegate: Table, segments: list[tuple[int, int]], inline: list[tuple[int, Table]], data: bytes, where: str
) -> _Delegate:
    backend = delegate.string(0, f"{where}: backend id")
    processed = delegate.table(1, f"{where}: payload")
    for spec in delegate.tables(2, f"{where}: compile spec"):
        spec.string(0, "a compile spec key")
        spec.length(1, 1, "a compile spec value")
    if backend is None or processed is None:
        raise Invalid(f"{where} has no backend id or no payload")
    location, index = processed.scalar(0, "b"), processed.scalar(1, "I")
    if location == 0:  # INLINE
        if index >= len(inline):
            raise Invalid(f"{where} reads inline payload {index}, but the program holds {len(inline)}")
        return _Delegate(None)
    if location != 1 or index >= len(segments):
        raise Invalid(f"{where} reads segment {index} (location {location}), but the program has {len(segments)}")
    if backend != _XNNPACK:
        return _Delegate(None)
    start, size = segments[index]
    return _Delegate(_xnnpack_externs(memoryview(data)[start : start + size], where))


def _xnnpack_externs(payload: memoryview, where: str) -> int:
    """The number of external values an XNNPACK payload's graph binds to the call's arguments (XNNHeader.h: magic
    "XH00" at 4, then u16 header length, u32 flatbuffer offset and size; XNNGraph field 3 is `num_externs`)."""
    if len(payload) < 18 or payload[4:8] != b"XH00":
        raise Invalid(f"{where}: its XNNPACK payload has no XNNPACK header")
    offset, size = struct.unpack_from("<II", payload, 10)
    if offset + size > len(payload):
        raise Invalid(f"{where}: its XNNPACK graph lies outside its payload")
    graph = Reader(payload[offset : offset + size], size).root()
    return graph.scalar(3, "I")


def _check_instruction(
    instruction: Table,
    count: int,
    tags: list[int],
    scalar_types: dict[int, int],
    operators: list[Operator],
    delegates: list[_Delegate],
    where: str,
) -> None:
    kind = instruction.scalar(0, "B")
    call = instruction.table(1, where)
    if call is None or not KERNEL_CALL <= kind <= FREE_CALL:
        raise Invalid(f"{where} is of unknown kind {kind}")
    n = len(tags)

    def value(index: int, what: str) -> int:
        if not 0 <= index < n:
            raise Invalid(f"{where}: {what} is value {index}, but the method has {n}")
        return tags[index]

    if kind in (KERNEL_CALL, DELEGATE_CALL):
        target = call.scalar(0, "i")
        args = call.vector(1, "i", f"{where}: arguments")
        if args is None:
            raise Invalid(f"{where} has no argument list")
        arg_tags = [value(a, f"argument {j}") for j, a in enumerate(args)]
        if kind == DELEGATE_CALL:
            if not 0 <= target < len(delegates):
                raise Invalid(f"{where} calls delegate {target}, but the method has {len(delegates)}")
            externs = delegates[target].arguments
            if externs is not None and len(args) != externs:
                raise Invalid(f"{where} passes {len(args)} arguments to a delegate graph that binds {externs}")
            if any(tag != TENSOR for tag in arg_tags):
                raise Invalid(f"{where} passes a non-tensor to a delegate")
            return
        if not 0 <= target < len(operators):
            raise Invalid(f"{where} calls operator {target}, but the method has {len(operators)}")
        op = operators[target]
        if len(args) != len(op.arguments):
            raise Invalid(f"{where} passes {len(args)} arguments to {op.name}, which takes {len(op.arguments)}")
        if op.result is not None:
            written = op.result(arg_tags[:-1], [scalar_types.get(a, -1) for a in args[:-1]])
            if written in (DOUBLE, BOOL) and arg_tags[-1] == INT and op.name.startswith("executorch_prim::"):
                # executorch's emitter serialises the result of every `executorch_prim` op (schema return
                # `Scalar`) as an `Int(0)` placeholder, "the runtime operator just overrides the EValue
                # completely" (`exir/emit/_emitter.py`): `truediv.Scalar` writes a double there (yolos' position
                # grid scale). Later instructions read the type it writes.
                tags[args[-1]] = written
            elif written is None or written != arg_tags[-1]:
                raise Invalid(
                    f"{where}: {op.name} on {[tag_name(t) for t in arg_tags[:-1]]} writes "
                    f"{tag_name(written) if written else 'nothing valid'} into a {tag_name(arg_tags[-1])}"
                )
            allowed: Sequence[frozenset[int] | None] = op.arguments[:-1]
        else:
            allowed = op.arguments
        for j, (tag, wanted) in enumerate(zip(arg_tags, allowed, strict=False)):
            if wanted is not None and tag not in wanted:
                names = "/".join(sorted(tag_name(t) for t in wanted))
                raise Invalid(f"{where}: argument {j} of {op.name} is a {tag_name(tag)}, it takes {names}")
    elif kind == MOVE_CALL:
        source, target = value(call.scalar(0, "i"), "the move source"), value(call.scalar(1, "i"), "the move target")
        if source != target:
            raise Invalid(f"{where} moves a {tag_name(source)} into a {tag_name(target)}")
    elif kind == JUMP_FALSE_CALL:
        if value(call.scalar(0, "i"), "the condition") not in (TENSOR, BOOL):
            raise Invalid(f"{where} jumps on a value that is neither a tensor nor a bool")
        if not 0 <= call.scalar(1, "i") <= count:
            raise Invalid(f"{where} jumps to instruction {call.scalar(1, 'i')} of {count}")
    elif value(call.scalar(0, "i"), "the freed value") != TENSOR:
        raise Invalid(f"{where} frees a value that is not a tensor")
