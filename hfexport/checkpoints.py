"""A Hugging Face safetensors checkpoint read one tensor at a time (the low-memory export's weight source).

`Checkpoint.open(folder)` reads only the shard index (or the single file's header): which shard holds which
tensor, its shape and dtype. `Checkpoint.load(name, dtype)` memory-maps that shard with `safetensors.safe_open`
and copies out one tensor, so a caller that writes weights one by one never holds more than one of them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from hfexport.errors import HfExportError, InputError

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
        """Index the safetensors files of `folder` (`model.safetensors`, or the shards its index names)."""
        folder = Path(folder)
        index = folder / INDEX_FILE
        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
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
            if Path(shard).is_absolute() or ".." in Path(shard).parts or not path.is_file():
                raise InputError(f"{index} names the shard {shard!r}, which is not a file in {folder}")
            for name, info in _read_header(path).items():
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


def _read_header(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype, int]]:
    """{tensor name: (shape, dtype, offset of its bytes)} from a safetensors file's header (the format: an 8-byte
    little-endian header length, a JSON header with each tensor's dtype, shape and data offsets, the data)."""
    with open(path, "rb") as file:
        length = int.from_bytes(file.read(8), "little")
        size = path.stat().st_size
        if not 0 < length <= size - 8:
            raise InputError(f"{path} is not a safetensors file (header length {length}, file {size} bytes)")
        header = json.loads(file.read(length))
    tensors = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise InputError(f"{path.name}: tensor {name!r} has dtype {entry['dtype']}, not supported here")
        begin, end = entry["data_offsets"]
        shape = tuple(entry["shape"])
        count = 1
        for dim in shape:
            count *= dim
        if end - begin != count * dtype.itemsize or 8 + length + end > size:
            raise InputError(f"{path.name}: tensor {name!r} has inconsistent data offsets {entry['data_offsets']}")
        tensors[name] = (shape, dtype, 8 + length + begin)
    return tensors


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
