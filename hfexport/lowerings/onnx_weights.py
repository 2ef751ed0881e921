"""Initializers of a low-memory ONNX export that write their checkpoint tensor in blocks of rows.

`onnx_ir.LazyTensor` writes a tensor by evaluating it whole: `safe_open(...).get_tensor` maps the shard and copies
the tensor out (its pages and the copy are both resident), and a folded transpose makes a third, permuted copy.
For the largest tensor (a tied embedding, vocab x hidden) that was the peak of the whole streamed export.
`StreamedTensor.tofile`, which `onnx_ir`'s external-data writer calls with the file positioned at the tensor's
offset, writes the same bytes from blocks of rows read with plain file reads (`Checkpoint.load_rows`), so at most
one block is held. Everything else (`numpy()`, `tobytes()`: the optimizer and the rules reading values) still
evaluates the whole tensor, as before.

Imported by `hfexport.lowerings.onnx.stream_weights` only: `import hfexport` must not import onnx_ir.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import onnx_ir as ir
import torch

from hfexport.core.checkpoints import Checkpoint

# Rows of a checkpoint tensor read, cast and written at a time (the block and its cast/transposed copy are held).
BLOCK_BYTES = 4 << 20


def write_rows(
    file: Any,
    checkpoint: Checkpoint,
    key: str,
    dtype: torch.dtype,
    perm: tuple[int, ...] | None = None,
    block_bytes: int = BLOCK_BYTES,
) -> None:
    """Write checkpoint tensor `key`, cast to `dtype` and permuted by `perm` (None, or a 2-D transpose), to `file`
    at its current position, as the bytes of the contiguous result (what `TorchTensor.tofile` writes), reading
    one block of rows (about `block_bytes`) at a time. The file is left positioned after the tensor."""
    start = file.tell()
    if perm is None or tuple(perm) == tuple(range(len(perm))):
        for block in checkpoint.load_rows(key, dtype, max_bytes=block_bytes):
            file.write(memoryview(block.contiguous().reshape(-1).view(torch.uint8).numpy()))
        return
    if tuple(perm) != (1, 0):
        raise ValueError(f"write_rows transposes 2-D tensors only, not perm={perm}")
    rows, cols = checkpoint.tensors[key].shape
    itemsize = dtype.itemsize
    row = 0
    # Rows r0..r1 of W are columns r0..r1 of W^T: each of its `cols` rows gets one contiguous run of them.
    for block in checkpoint.load_rows(key, dtype, max_bytes=block_bytes):
        count = block.shape[0]
        # Flat first: a one-row block's transpose counts as contiguous with a last stride of `cols`.
        raw = block.t().contiguous().reshape(-1).view(torch.uint8).numpy().reshape(cols, -1)
        for col in range(cols):
            file.seek(start + (col * rows + row) * itemsize)
            file.write(memoryview(raw[col]))
        row += count
    file.seek(start + rows * cols * itemsize)


class StreamedTensor(ir.LazyTensor):
    """A `LazyTensor` whose `tofile` writes its checkpoint tensor in blocks (`write_rows`) instead of evaluating
    it whole; `numpy()` and `tobytes()` still evaluate `func` (the whole tensor)."""

    __slots__ = ("_write",)

    def __init__(self, func: Callable[[], Any], write: Callable[[Any], None], **kwargs: Any) -> None:
        super().__init__(func, **kwargs)
        self._write = write

    def tofile(self, file: Any) -> None:
        self._write(file)
