"""A Hugging Face safetensors checkpoint read one tensor at a time (the low-memory export's weight source).

`Checkpoint.open(folder)` reads only the shard index (or the single file's header): which shard holds which
tensor, its shape and dtype. `Checkpoint.load(name, dtype)` memory-maps that shard with `safetensors.safe_open`
and copies out one tensor, so a caller that writes weights one by one never holds more than one of them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import torch

from hfexport.core.errors import HfExportError, InputError
from hfexport.core.files import is_inside_model_folder

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorInfo:
    """Where a checkpoint tensor lives and what it is, read from the shard header (no data)."""

    shard: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int = 0
    """Where the tensor's bytes start in the shard file."""


@dataclass(frozen=True)
class Checkpoint:
    """The tensors of a checkpoint folder by name (state_dict keys), each read on demand from its shard."""

    folder: Path
    tensors: dict[str, TensorInfo]

    @classmethod
    def open(cls, folder: str | Path) -> Checkpoint:
        """Index the safetensors files of `folder` (`model.safetensors`, or the shards its index names).

        Every header is validated as safetensors validates it, before any tensor is read: a malformed header,
        index or shard is one `InputError` naming the file (and the tensor), never a raw exception later."""
        folder = Path(folder)
        index = folder / INDEX_FILE
        if index.is_file():
            shards = _read_index(index, folder)
        elif (folder / SINGLE_FILE).is_file():
            shards = [SINGLE_FILE]
        else:
            raise InputError(
                f"{folder} holds no safetensors checkpoint ({SINGLE_FILE} or {INDEX_FILE}); the low-memory export "
                "streams weights from safetensors only: save the model with save_pretrained(safe_serialization=True)"
            )
        tensors: dict[str, TensorInfo] = {}
        for shard in shards:
            path = folder / shard
            if not is_inside_model_folder(path, folder):
                raise InputError(f"{path} leads outside {folder} (a symlink): a checkpoint is read from its folder")
            for name, info in _read_header(path).items():
                if name in tensors:
                    raise InputError(f"{path}: tensor {name!r} is also in {tensors[name].shard}")
                tensors[name] = TensorInfo(shard, *info)
        return cls(folder, tensors)

    def __contains__(self, name: object) -> bool:
        return name in self.tensors

    def load(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Tensor `name`, contiguous on the CPU, cast to `dtype` when given; only this tensor is read."""
        from safetensors import safe_open

        info = self.tensors[name]
        with safe_open(str(self.folder / info.shard), framework="pt") as handle:
            tensor = handle.get_tensor(name)
        if dtype is not None and tensor.dtype != dtype:
            tensor = tensor.to(dtype)
        return tensor.contiguous()

    def load_rows(
        self, name: str, dtype: torch.dtype | None = None, max_bytes: int = 64 << 20
    ) -> Iterator[torch.Tensor]:
        """Tensor `name` in consecutive blocks of rows (first dimension) of at most about `max_bytes` each, cast
        to `dtype` when given: a tensor larger than memory is read a block at a time. Read with plain file reads,
        not a memory map, so that the pages read do not stay mapped into the process (its resident size)."""
        info = self.tensors[name]
        rows = info.shape[0] if info.shape else 1
        row_elements = 1
        for size in info.shape[1:]:
            row_elements *= size
        step = max(1, max_bytes // max(1, row_elements * max(info.dtype.itemsize, (dtype or info.dtype).itemsize)))
        with open(self.folder / info.shard, "rb", buffering=0) as file:
            file.seek(info.offset)
            for start in range(0, rows, step):
                count = min(step, rows - start)
                block = torch.empty(count * row_elements * info.dtype.itemsize, dtype=torch.uint8)
                if file.readinto(memoryview(block.numpy())) != block.numel():
                    raise InputError(f"{info.shard}: tensor {name!r} ends past the end of the file")
                tensor = block.view(info.dtype).reshape((count, *info.shape[1:]) if info.shape else ())
                yield tensor.to(dtype) if dtype is not None and dtype != info.dtype else tensor

    @property
    def nbytes(self) -> int:
        """The size of the checkpoint's tensor data, in bytes."""
        total = 0
        for info in self.tensors.values():
            count = 1
            for size in info.shape:
                count *= size
            total += count * info.dtype.itemsize
        return total


# safetensors' own cap on a header (`MAX_HEADER_SIZE`); a header past it is refused before it is read.
MAX_HEADER_BYTES = 100_000_000
# An index names each tensor once (a real one is tens of KiB to a few MiB).
MAX_INDEX_BYTES = 100_000_000
_U64 = 1 << 64


def _parse_json(raw: bytes, what: str) -> Any:
    """`raw` as JSON (UTF-8, no NaN/Infinity, as serde_json reads it), or an `InputError` naming `what`."""
    try:
        return json.loads(raw.decode("utf-8"), parse_constant=_no_constant)
    except UnicodeDecodeError as exc:
        raise InputError(f"{what} is not UTF-8 text (byte {exc.start}): not a safetensors checkpoint") from None
    except (ValueError, RecursionError) as exc:  # JSONDecodeError, NaN, an integer of over 4300 digits, nesting
        raise InputError(f"{what} is not valid JSON: {type(exc).__name__}: {str(exc)[:200]}") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _read_index(index: Path, folder: Path) -> list[str]:
    """The shard files `model.safetensors.index.json` names in its `weight_map` ({tensor: shard file}), each a
    file of `folder` (no absolute path, no `..`)."""
    size = index.stat().st_size
    if size > MAX_INDEX_BYTES:
        raise InputError(f"{index} is {size} bytes; a checkpoint index is at most {MAX_INDEX_BYTES}")
    with open(index, "rb") as file:  # read(n) allocates n bytes up front: read what the file holds, bounded
        data = _parse_json(file.read(min(size, MAX_INDEX_BYTES) + 1), str(index))
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict):
        raise InputError(f"{index} has no weight_map object ({{tensor name: shard file}}): not a checkpoint index")
    shards = set()
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise InputError(f"{index}: weight_map[{name!r}] is {shard!r}, not the name of a shard file")
        shards.add(shard)
    for shard in shards:
        parts = PurePosixPath(shard).parts
        if PurePosixPath(shard).is_absolute() or ".." in parts or "\\" in shard or not (folder / shard).is_file():
            raise InputError(f"{index} names the shard {shard!r}, which is not a file in {folder}")
    return sorted(shards)


def _read_header(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype, int]]:
    """{tensor name: (shape, dtype, offset of its bytes)} from a safetensors file's header (the format: an 8-byte
    little-endian header length, a JSON header with each tensor's dtype, shape and data offsets, the data).

    Validated as the safetensors library validates it (`safe_open`), so that nothing it refuses is read here:
    a header of at most `MAX_HEADER_BYTES` inside the file, a UTF-8 JSON object of tensor name ->
    {dtype, shape, data_offsets} (and `__metadata__`, str -> str), shapes of non-negative integers, offsets of
    unsigned 64-bit integers holding exactly the tensor's bytes, and the tensors covering the data section
    exactly (contiguous, in order of offsets, no overlap, no gap, nothing after)."""
    size = path.stat().st_size
    with open(path, "rb") as file:
        head = file.read(8)
        length = int.from_bytes(head, "little")
        if len(head) < 8 or not 0 < length <= size - 8:
            raise InputError(f"{path} is not a safetensors file (header length {length}, file {size} bytes)")
        if length > MAX_HEADER_BYTES:
            raise InputError(f"{path} claims a header of {length} bytes; safetensors allows {MAX_HEADER_BYTES}")
        header = _parse_json(file.read(length), f"the header of {path}")
    if not isinstance(header, dict):
        raise InputError(f"the header of {path} is a JSON {type(header).__name__}, not an object of tensors")
    metadata = header.get("__metadata__")
    if metadata is not None and (
        not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values())
    ):
        raise InputError(f"{path}: __metadata__ is not an object of strings")
    entries = []
    for name, entry in header.items():
        if name != "__metadata__":
            entries.append((*_tensor_entry(path, name, entry), name))
    data_size = size - 8 - length
    expected = 0
    tensors = {}
    for begin, end, shape, dtype, name in sorted(entries, key=lambda e: (e[0], e[1])):
        if begin != expected:
            what = "overlap another tensor's bytes" if begin < expected else "leave a gap after the previous tensor's"
            raise InputError(
                f"{path}: tensor {name!r} has data offsets [{begin}, {end}], which {what} (ending at {expected}): "
                "the tensors must cover the data section contiguously"
            )
        expected = end
        tensors[name] = (shape, dtype, 8 + length + begin)
    if expected != data_size:
        raise InputError(
            f"{path}: the tensors cover {expected} bytes of the data section, which has {data_size} (a "
            "truncated or padded file)"
        )
    return tensors


def _tensor_entry(path: Path, name: str, entry: Any) -> tuple[int, int, tuple[int, ...], torch.dtype]:
    """(begin, end, shape, dtype) of one header entry, each of its type (as serde reads safetensors' schema)."""
    where = f"{path}: tensor {name!r}"
    if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= set(entry):
        raise InputError(f"{where} is not an object with dtype, shape and data_offsets")
    name_of_dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(name_of_dtype, str) or name_of_dtype not in _KNOWN_DTYPES:
        raise InputError(f"{where} has dtype {name_of_dtype!r}, which safetensors does not define")
    dtype = _SAFETENSORS_DTYPES.get(name_of_dtype)
    if dtype is None:
        raise InputError(f"{where} has dtype {name_of_dtype}, not supported here")
    if not isinstance(shape, list) or not all(_is_u64(dim) for dim in shape):
        raise InputError(f"{where} has shape {str(shape)[:80]}, not a list of non-negative integers")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_u64(o) for o in offsets):
        raise InputError(f"{where} has data_offsets {str(offsets)[:80]}, not [begin, end] in unsigned integers")
    begin, end = offsets
    count = 1
    for dim in shape:
        count *= dim
    if end < begin or end - begin != count * dtype.itemsize:
        raise InputError(
            f"{where} has data offsets [{begin}, {end}] for {count} elements of {name_of_dtype} "
            f"({count * dtype.itemsize} bytes)"
        )
    return begin, end, tuple(shape), dtype


def _is_u64(value: Any) -> bool:
    return type(value) is int and 0 <= value < _U64


@dataclass(frozen=True)
class WeightSource:
    """Where a low-memory export's weights come from: the checkpoint and {weight name: checkpoint tensor name}."""

    checkpoint: Checkpoint
    names: Mapping[str, str]

    def key_of(self, name: str, what: str = "weight") -> str:
        """The checkpoint tensor that holds the empty (FakeTensor) `name`; refused when none does, since a
        low-memory export can only write what it reads from the checkpoint."""
        key = self.names.get(name)
        if key is None:
            raise HfExportError(
                f"the {what} {name!r} has no values (a FakeTensor) and is no checkpoint tensor: the low-memory "
                "export can only write weights it reads from the checkpoint; export without low_memory",
                stage="weights",
            )
        return key


_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
# Every dtype name of the safetensors format (0.8): the others than above are refused as unsupported here.
_KNOWN_DTYPES = frozenset(_SAFETENSORS_DTYPES) | {"F4", "F6_E2M3", "F6_E3M2", "U16", "U32", "U64", "C64"}
_KNOWN_DTYPES |= {"F8_E5M2", "F8_E4M3", "F8_E8M0", "F8_E4M3FNUZ", "F8_E5M2FNUZ"}


# The default export (CLI) streams a checkpoint whose weights take more than this share of the available memory:
# loading takes the weights once, and the in-memory lowerings hold up to about one more copy (docs/benchmarks.md).
AUTO_LOW_MEMORY_SHARE = 0.5


def available_memory() -> int | None:
    """The memory available to a new allocation, in bytes (Linux `MemAvailable`); None where unknown."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def low_memory_reason(
    folder: str | Path, available: int | None = None, share: float = AUTO_LOW_MEMORY_SHARE
) -> str | None:
    """Why the safetensors checkpoint of `folder` should be exported on the low-memory path: its weights take
    more than `share` of `available` bytes (None: `available_memory()`). None when they fit, when the folder has
    no safetensors checkpoint, or when the available memory is unknown."""
    folder = Path(folder)
    if not ((folder / INDEX_FILE).is_file() or (folder / SINGLE_FILE).is_file()):
        return None
    available = available_memory() if available is None else available
    if not available:
        return None
    size = Checkpoint.open(folder).nbytes
    if size <= share * available:
        return None
    return (
        f"the checkpoint's weights ({size / 1e9:.2f} GB) take more than {share:.0%} of the available memory "
        f"({available / 1e9:.2f} GB)"
    )
