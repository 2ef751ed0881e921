"""A Hugging Face safetensors checkpoint read one tensor at a time (the low-memory export's weight source).

`Checkpoint.open(folder)` reads only the shard index (or the single file's header): which shard holds which
tensor, its shape and dtype. `Checkpoint.load(name, dtype)` memory-maps that shard with `safetensors.safe_open`
and copies out one tensor, so a caller that writes weights one by one never holds more than one of them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from hfexport.errors import InputError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


@dataclass(frozen=True)
class TensorInfo:
    """Where a checkpoint tensor lives and what it is, read from the shard header (no data)."""

    shard: str
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class Checkpoint:
    """The tensors of a checkpoint folder by name (state_dict keys), each read on demand from its shard."""

    folder: Path
    tensors: dict[str, TensorInfo]

    @classmethod
    def open(cls, folder: str | Path) -> Checkpoint:
        """Index the safetensors files of `folder` (`model.safetensors`, or the shards its index names)."""
        from safetensors import safe_open

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
            with safe_open(str(path), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                    piece = handle.get_slice(name)
                    dtype = _SAFETENSORS_DTYPES.get(piece.get_dtype())
                    if dtype is None:
                        raise InputError(f"{shard}: tensor {name!r} has dtype {piece.get_dtype()}, not supported here")
                    tensors[name] = TensorInfo(shard, tuple(piece.get_shape()), dtype)
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


@dataclass(frozen=True)
class WeightSource:
    """Where a low-memory export's weights come from: the checkpoint and {weight name: checkpoint tensor name}."""

    checkpoint: Checkpoint
    names: Mapping[str, str]


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
