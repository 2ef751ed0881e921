"""ExecuTorch programs (`.pte` flatbuffers, schema `executorch/schema/program.fbs`) written field by field.

ExecuTorch's own serializer writes every table once; a hostile file need not. `program` builds a program whose
vectors may point many entries at one table (the plans at one plan, a plan's chains at one chain, a chain's
instructions at one instruction, values at one int list), the shape that made the structure check visit a table
once per reference (issue #39, item 3b). Field slots and union tags follow
`hfexport/artifacts/pte.py` and `hfexport/artifacts/pte_operators.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hfexport.artifacts.pte import MOVE_CALL
from hfexport.artifacts.pte_operators import INT, INT_LIST


@dataclass(frozen=True)
class Shape:
    """How many references each level holds; each level's references all point at one shared table."""

    plans: int = 1
    chains: int = 1
    instructions: int = 1
    list_values: int = 0  # values that all point at one int-list value's payload
    list_items: int = 0  # items of that int list (each names value 0, an int)


def program(shape: Shape, identifier: bytes = b"ET12") -> bytes:
    """A program whose one method has an int value (0), `list_values` int-list values sharing one list of
    `list_items` items, and `instructions` moves of value 0 into itself; consistent for the structure check."""
    import flatbuffers

    b = flatbuffers.Builder(1024)

    def table(fields: dict[int, tuple[str, Any]]) -> int:
        b.StartObject(max(fields, default=-1) + 1)
        for slot, (kind, value) in sorted(fields.items(), reverse=True):
            if kind == "ref":
                b.PrependUOffsetTRelativeSlot(slot, value, 0)
            elif kind == "u8":
                b.PrependUint8Slot(slot, value, 0)
            else:
                b.PrependInt64Slot(slot, value, 0)
        return b.EndObject()

    def refs(target: int, count: int) -> int:
        b.StartVector(4, count, 4)
        for _ in range(count):
            b.PrependUOffsetTRelative(target)
        return b.EndVector()

    move = table({})  # MoveCall: move_from = move_to = value 0
    instruction = table({0: ("u8", MOVE_CALL), 1: ("ref", move)})
    chain = table({2: ("ref", refs(instruction, shape.instructions))})
    b.StartVector(8, shape.list_items, 8)
    for _ in range(shape.list_items):
        b.PrependInt64(0)
    items = b.EndVector()
    int_list = table({0: ("ref", items)})
    list_value = table({0: ("u8", INT_LIST), 1: ("ref", int_list)})
    integer = table({0: ("i64", 7)})
    first = table({0: ("u8", INT), 1: ("ref", integer)})
    b.StartVector(4, 1 + shape.list_values, 4)
    for _ in range(shape.list_values):
        b.PrependUOffsetTRelative(list_value)
    b.PrependUOffsetTRelative(first)
    values = b.EndVector()
    chains = refs(chain, shape.chains)
    name = b.CreateString("forward")
    plan = table({0: ("ref", name), 2: ("ref", values), 5: ("ref", chains)})
    root = table({1: ("ref", refs(plan, shape.plans))})
    b.Finish(root, file_identifier=identifier)
    return bytes(b.Output())


# -- arbitrary flatbuffers: tables of any fields, shared between references ---------------------------------


@dataclass(frozen=True, eq=False)
class Table:
    """A flatbuffer table: slot -> (kind, value). Kinds: `u8`, `i32`, `i64` (scalars), `ref` (a Table), `refs` (a
    vector of Tables, repeats allowed), `ints` (a vector of int32), `longs` (int64), `bytes` (a vector of bytes),
    `text` (a string, any bytes). The same Table object referenced twice is written once (a shared table)."""

    fields: dict[int, tuple[str, Any]]


def write(root: Table, identifier: bytes = b"ET12") -> bytes:
    """The flatbuffer of `root` (children first, each Table once), with the file identifier at bytes 4-8."""
    import flatbuffers

    b = flatbuffers.Builder(1024)
    b.ForceDefaults(True)
    offsets: dict[int, int] = {}

    def scalars(kind: str, values: list[int]) -> int:
        size, prepend = {"ints": (4, b.PrependInt32), "longs": (8, b.PrependInt64), "bytes": (1, b.PrependUint8)}[kind]
        b.StartVector(size, len(values), size)
        for value in reversed(values):
            prepend(value)
        return b.EndVector()

    def build(table: Table) -> int:
        if id(table) in offsets:
            return offsets[id(table)]
        children: dict[int, int] = {}
        for slot, (kind, value) in table.fields.items():
            if kind == "ref":
                children[slot] = build(value)
            elif kind == "refs":
                targets = [build(item) for item in value]
                b.StartVector(4, len(targets), 4)
                for target in reversed(targets):
                    b.PrependUOffsetTRelative(target)
                children[slot] = b.EndVector()
            elif kind in ("ints", "longs", "bytes"):
                children[slot] = scalars(kind, value)
            elif kind == "text":
                children[slot] = b.CreateString(value)
        b.StartObject(max(table.fields, default=-1) + 1)
        for slot, (kind, value) in sorted(table.fields.items(), reverse=True):
            if slot in children:
                b.PrependUOffsetTRelativeSlot(slot, children[slot], 0)
            elif kind == "u8":
                b.PrependUint8Slot(slot, value, 0)
            elif kind == "i32":
                b.PrependInt32Slot(slot, value, 0)
            else:
                b.PrependInt64Slot(slot, value, 0)
        offsets[id(table)] = b.EndObject()
        return offsets[id(table)]

    b.Finish(build(root), file_identifier=identifier)
    return bytes(b.Output())
