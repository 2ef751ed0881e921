"""A bounds-checked reader of flatbuffers that trusts no offset or length in the bytes it reads.

Every read is checked to lie inside the buffer, and the number of reads is bounded by the buffer's size, so a
damaged or hostile file (an `.pte` program, an XNNPACK payload inside one) fails with `Invalid` in time
proportional to its size instead of reading out of bounds or looping over shared tables.
"""

from __future__ import annotations

import struct
from typing import Any


class Invalid(Exception):
    """A structural fault; `check_program` turns it into an `ArtifactError` naming the file."""


# Reads the check may make per byte of the program (plus a fixed allowance). A program's tables are each read a
# few times (a real program uses under 4 per byte: tools/fuzz_pte.py), but a flatbuffer may point many vector
# entries at one table (a plan's chains, a chain's instructions, values at one list): the check then visits that
# table once per reference, P*C*I visits for a few KB (an 8.6 KB file took more than 240 s). Charging every
# read bounds the check's time by the file's size whatever the sharing.
READS_PER_BYTE = 64
_READ_ALLOWANCE = 1 << 16
_READ_COST = 8  # per read, on top of its bytes: a read of a few bytes costs a Python call all the same


class Reader:
    """Little-endian reads inside `data[:end]` that refuse any position outside it, and refuse to read more than
    `READS_PER_BYTE` times the program's size in all (shared tables read once per reference)."""

    def __init__(self, data: bytes | memoryview, end: int) -> None:
        self.data = data
        self.end = end
        self.budget = READS_PER_BYTE * end + _READ_ALLOWANCE
        self.spent = 0

    def need(self, pos: int, size: int, what: str) -> None:
        if pos < 0 or size < 0 or pos + size > self.end:
            raise Invalid(f"{what} (bytes {pos}..{pos + size}) lies outside the program ({self.end} bytes)")
        self.spent += size + _READ_COST
        if self.spent > self.budget:
            raise Invalid(
                f"reading it takes more than {READS_PER_BYTE} reads per byte of its {self.end} bytes: its tables are "
                "shared between many references (a program ExecuTorch writes reads each table a few times)"
            )

    def read(self, fmt: str, pos: int, what: str) -> Any:
        self.need(pos, struct.calcsize(fmt), what)
        return struct.unpack_from("<" + fmt, self.data, pos)[0]

    def root(self) -> Table:
        return Table(self, self.read("I", 0, "the root offset"), "the program")


class Table:
    """A flatbuffer table: fields by slot number (a union takes two slots: its type, then its value)."""

    __slots__ = ("_len", "pos", "r", "vtable", "vtable_len", "what")

    def __init__(self, reader: Reader, pos: int, what: str) -> None:
        self.r, self.pos, self.what = reader, pos, what
        self.vtable = pos - reader.read("i", pos, what)
        self.vtable_len = reader.read("H", self.vtable, f"the field table of {what}")
        self._len = reader.read("H", self.vtable + 2, f"the field table of {what}")
        if self.vtable_len < 4 or self.vtable_len % 2:
            raise Invalid(f"the field table of {what} has a bad length {self.vtable_len}")
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
            raise Invalid(f"a field of {self.what} lies past the end of its table")
        return self.pos + offset

    def scalar(self, slot: int, fmt: str, default: Any = 0) -> Any:
        at = self._field(slot, struct.calcsize(fmt))
        return self.r.read(fmt, at, self.what) if at else default

    def _ref(self, slot: int, what: str) -> int | None:
        at = self._field(slot, 4)
        return at + self.r.read("I", at, what) if at else None

    def table(self, slot: int, what: str) -> Table | None:
        at = self._ref(slot, what)
        return Table(self.r, at, what) if at is not None else None

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

    def tables(self, slot: int, what: str) -> list[Table]:
        at = self._ref(slot, what)
        if at is None:
            return []
        count = self.r.read("I", at, what)
        self.r.need(at + 4, 4 * count, what)
        return [
            Table(self.r, at + 4 + 4 * i + self.r.read("I", at + 4 + 4 * i, what), f"{what} {i}") for i in range(count)
        ]

    def string(self, slot: int, what: str) -> str | None:
        at = self._ref(slot, what)
        if at is None:
            return None
        count = self.r.read("I", at, what)
        self.r.need(at + 4, count + 1, what)
        raw = bytes(self.r.data[at + 4 : at + 4 + count])
        if self.r.data[at + 4 + count] != 0:
            raise Invalid(f"{what} is not NUL-terminated")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise Invalid(f"{what} is not UTF-8 text") from None
