"""NNCF's int4 unpacking (`bitwise_right_shift` of packed bytes): the example model of the rules that let it through
on each backend (`openvino/quant-right-shift-as-floor-scale`, `executorch/quant-right-shift-verifier`)."""

from __future__ import annotations

import torch

from hfexport.rewrites.examples import Built


class Unpack(torch.nn.Module):
    """Right shifts of every value of a byte buffer (NNCF's int4 unpacking, plus the other shift amounts), as
    floats: one output per shift amount, compared with eager exactly."""

    def __init__(self, dtype: torch.dtype = torch.uint8, shifts: tuple[int, ...] = (4, 1, 7)) -> None:
        super().__init__()
        low = 0 if dtype == torch.uint8 else -128
        self.register_buffer("packed", torch.arange(low, low + 256).to(dtype).reshape(16, 16))
        self.shifts = shifts

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        low = torch.bitwise_and(self.packed, 15)
        nibbles = [torch.stack([low, torch.bitwise_right_shift(self.packed, 4)], -1).reshape(16, 32)]
        others = [torch.bitwise_right_shift(self.packed, k) for k in self.shifts if k != 4]
        return tuple(x + t.to(torch.float32) for t in nibbles) + tuple(x[:, :16] + t.to(torch.float32) for t in others)


def unpack_example(dtype: torch.dtype = torch.uint8) -> Built:
    return Unpack(dtype), {"x": torch.zeros(16, 32)}
