"""NNCF weight compression (`NNCFTorchFXQuantizer(NNCFWeightCompressionConfig(...))`) on ExecuTorch.

`nncf.compress_weights` on a Torch FX graph stores each linear weight as an integer buffer and rebuilds the float
weight in the graph before every `linear`: int8 as `(w.to(f16) - zero_point) * scale`, int4 packed two to a
byte and unpacked with `bitwise_and(w, 15)` / `bitwise_right_shift(w, 4)`. Two things stop that graph short of
the ExecuTorch runtime (executorch 1.4.1, nncf 3.4):

- `aten.bitwise_right_shift` is not core ATen, so `to_edge` refuses it, although the portable kernel library
  has it (`bitwise_right_shift.Tensor_Scalar_out`); executorch's own advice is the verifier's exception list.
- XNNPACK delegates a `linear` only on a static weight, so a linear on a computed weight is decomposed, and
  its `ConvertToLinearPass`, which finds the decomposition tagged as coming from an `nn.Linear`, rebuilds a
  `linear` from it. On an input that is not contiguous (the attention output before `o_proj` is a
  transposed view) the decomposition is `expand` + `bmm`, and the rebuilt linear on the 3-D expanded weight
  fails ("t() expects a tensor with <= 2 dimensions"). On any other input it is `view` + `addmm`, and the
  rebuilt linear computes wrong values (off by ~2000 on outputs of ~11 in the examples): it does not use the
  weight the graph computes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from hfexport.rewrites.examples import Built

aten = torch.ops.aten
_LINEAR = aten.linear.default
# What `get_source_partitions` (and so ConvertToLinearPass) reads to find the nn.Linear a node came from.
_SOURCE_TAGS = frozenset({"source_fn_stack", "nn_module_stack", "torch_fn"})
RIGHT_SHIFTS = (aten.bitwise_right_shift.Tensor_Scalar, aten.bitwise_right_shift.Tensor)


# -- int4 unpacking: the shift passes the verifier ---------------------------------------------------------------


class _Nibbles(torch.nn.Module):
    """Nibbles by integer division: no shift in the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("packed", torch.arange(256, dtype=torch.uint8).reshape(16, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        nibbles = torch.stack(
            [torch.bitwise_and(self.packed, 15), torch.div(self.packed, 16, rounding_mode="floor")], -1
        )
        return x + nibbles.reshape(16, 32).to(torch.float32)


def nibbles_example() -> Built:
    return _Nibbles(), {"x": torch.zeros(16, 32)}


# -- linear on a computed weight: no nn.Linear tag ---------------------------------------------------------------


def is_computed_weight_linear(node: fx.Node) -> bool:
    """`linear(x, w, ...)` with w computed in the graph (not a parameter, buffer or constant), still tagged with the
    module it came from; any input rank (each decomposition of it is rebuilt wrongly, see the module's doc)."""
    if node.op != "call_function" or node.target is not _LINEAR or not (_SOURCE_TAGS & node.meta.keys()):
        return False
    x, weight = node.args[0], node.args[1]
    if not isinstance(x, fx.Node) or not isinstance(weight, fx.Node) or weight.op == "placeholder":
        return False
    if str(weight.target).startswith("quantized_decomposed."):
        return False  # a PT2E weight (dequantize of an int8 constant): XNNPACK lowers it as a quantized linear
    value, weight_value = x.meta.get("val"), weight.meta.get("val")
    return isinstance(value, torch.Tensor) and isinstance(weight_value, torch.Tensor) and weight_value.ndim == 2


def untag_linear(gm: fx.GraphModule, node: fx.Node) -> None:
    """The same `linear` without its source-module tags. Its decomposition is unchanged (expand + bmm, or view +
    addmm), and XNNPACK runs the `bmm` as the batch matmul it is, and the `addmm` as the portable kernel,
    instead of rebuilding a linear from them."""
    with gm.graph.inserting_before(node):
        linear = gm.graph.call_function(_LINEAR, node.args, dict(node.kwargs))
    linear.meta = {k: v for k, v in node.meta.items() if k not in _SOURCE_TAGS}
    node.replace_all_uses_with(linear)
    gm.graph.erase_node(node)


def _decompress(linear: torch.nn.Module, args: Any) -> None:
    # NNCF's int8 asymmetric decompression, run in the linear's own scope as NNCF's decompressor module is.
    weight = (linear.packed.to(torch.float16) - linear.zero_point.to(torch.float16)) * linear.scale
    linear.weight = weight.to(torch.float32)


class TransposedLinear(torch.nn.Module):
    """An `nn.Linear` on a transposed input ([seq, batch, features] -> [batch, seq, features], not contiguous, as
    the attention output before `o_proj`). `compressed`: its weight is int8 in a buffer and decompressed before
    each call; `rows`: a 2-D input, not transposed."""

    def __init__(self, compressed: bool = True, rows: bool = False) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(24, 20)
        self.rows = rows
        if compressed:
            generator = torch.Generator().manual_seed(0)
            del self.linear.weight
            packed = torch.randint(0, 256, (20, 24), generator=generator).to(torch.uint8)
            self.linear.register_buffer("packed", packed)
            self.linear.register_buffer(
                "zero_point", torch.randint(100, 156, (20, 1), generator=generator).to(torch.uint8)
            )
            self.linear.register_buffer("scale", (torch.rand(20, 1, generator=generator) / 64).to(torch.float16))
            self.linear.register_forward_pre_hook(_decompress)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x if self.rows else x.transpose(0, 1))


def inputs(*shape: int, seed: int = 0) -> dict[str, Any]:
    return {"x": torch.randn(*shape, 24, generator=torch.Generator().manual_seed(seed))}
