"""Weight-only quantization of a low-memory OpenVINO export, computed from the checkpoint one weight at a time.

NNCF's data-free weight compression (`nncf.compress_weights`, int8/int4, no dataset, no AWQ/GPTQ/scale
estimation, every weight in the chosen mode) computes each compressed weight, scale and zero point from that one
weight alone. The low-memory export runs NNCF on the model built on placeholders (zeros), which gives the graph
NNCF would build (which weights, which mode: embeddings and the head in the int8 backup mode, group size): only
their values are wrong. `save_ir` writes those constants from the checkpoint instead, each weight read, quantized
by NNCF's own `compress_weight` and turned into OpenVINO constants by NNCF's own `create_ov_const_from_tensor`,
so the bytes are the in-memory export's (tests/test_low_memory_quantize.py).

NNCF names the compressed constant after the weight's Const (which `mark_streamed` named after the weight), and
its decompression constants `<name>/scale` and `<name>/zero_point` (`OVWeightCompressionAlgoBackend.
_create_compression_subgraph`, nncf 3.4). What each was compressed with is read back from the IR: the compressed
element type gives the mode (i4: int4_sym, u4: int4_asym, i8: int8_sym, u8: int8_asym), one more dimension than
the weight gives the group size and its axis, and otherwise the scale's size-1 axis is the reduction axis.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hfexport.checkpoints import Checkpoint
from hfexport.errors import HfExportError

# The compressed Const's element type -> the NNCF mode that writes it (OpenVINO backend, nncf 3.4).
MODES = {"i4": "int4_sym", "u4": "int4_asym", "i8": "int8_sym", "u8": "int8_asym"}
# The decompression constants NNCF adds beside the compressed weight, by suffix of the weight's Const name.
PARTS = ("", "/scale", "/zero_point")


@dataclass(frozen=True)
class QuantizedWeight:
    """A streamed weight that NNCF compressed: which checkpoint tensor, and how (read back from the IR)."""

    name: str  # the weight's Const name (the compressed Const keeps it)
    key: str  # the checkpoint tensor
    dtype: torch.dtype  # the graph's dtype the weight was compressed from
    mode: str  # an nncf.CompressWeightsMode value
    group_size: int  # -1: per channel
    axis: int  # the reduction axis of the weight
    element_type: str  # of the compressed Const
    parts: tuple[str, ...]  # the suffixes of its Consts in the IR ("", "/scale", "/zero_point")


def _shape(data: ET.Element) -> tuple[int, ...]:
    text = data.get("shape", "")
    return tuple(int(s) for s in text.split(",")) if text.strip() else ()


def quantized_weights(
    root: ET.Element, record: Mapping[str, list[str]], checkpoint: Checkpoint
) -> dict[str, tuple[QuantizedWeight, str]]:
    """{Const name: (its weight, part suffix)} for every Const of the IR `root` that NNCF computed from a streamed
    weight (recorded by `mark_streamed`) while that weight was a placeholder."""
    consts = {
        layer.get("name", ""): data
        for layer in root.iter("layer")
        if layer.get("type") == "Const" and (data := layer.find("data")) is not None
    }
    found: dict[str, tuple[QuantizedWeight, str]] = {}
    for name, (key, dtype) in record.items():
        data = consts.get(name)
        if data is None or data.get("element_type") not in MODES:
            continue
        element_type = data.get("element_type", "")
        compressed, weight = _shape(data), tuple(checkpoint.tensors[key].shape)
        scale = consts.get(f"{name}/scale")
        if scale is None:
            raise HfExportError(f"the compressed weight {name!r} has no Const {name}/scale", stage="save")
        axis, group_size = _reduction(name, weight, compressed, _shape(scale))
        parts = tuple(suffix for suffix in PARTS if f"{name}{suffix}" in consts)
        quantized = QuantizedWeight(
            name, key, getattr(torch, dtype), MODES[element_type], group_size, axis, element_type, parts
        )
        for suffix in parts:
            found[f"{name}{suffix}"] = (quantized, suffix)
    return found


def _reduction(
    name: str, weight: tuple[int, ...], compressed: tuple[int, ...], scale: tuple[int, ...]
) -> tuple[int, int]:
    """(reduction axis, group size) of a weight NNCF compressed to `compressed` with scales of shape `scale`:
    grouped quantization reshapes [a1, r, a2] to [a1, r // g, g, a2] (`reshape_weight_for_grouped_quantization`)."""
    if len(compressed) == len(weight) + 1:
        for i in range(len(weight)):
            if (
                compressed[:i] == weight[:i]
                and compressed[i + 2 :] == weight[i + 1 :]
                and compressed[i] * compressed[i + 1] == weight[i]
            ):
                return i, compressed[i + 1]
    elif compressed == weight and len(scale) == len(weight):
        axes = [i for i, (s, w) in enumerate(zip(scale, weight, strict=True)) if s == 1 and w != 1]
        if len(axes) == 1:
            return axes[0], -1
    raise HfExportError(
        f"the weight {name!r} {weight} was compressed to {compressed} with scales {scale}: not a layout the "
        "low-memory export can recompute from the checkpoint; export without low_memory",
        stage="save",
    )


def compress(quantized: QuantizedWeight, checkpoint: Checkpoint) -> dict[str, bytes]:
    """{part suffix: bytes} of the Consts NNCF writes for the checkpoint tensor of `quantized`: the tensor is read
    (only it), given to NNCF's `compress_weight` as the in-memory export gives it (an `openvino.Tensor` of the
    graph's dtype) and each result made an OpenVINO constant by NNCF's `create_ov_const_from_tensor`."""
    import openvino as ov
    from nncf.common.utils.caching import disable_results_caching
    from nncf.openvino.graph.node_utils import create_ov_const_from_tensor
    from nncf.openvino.optimized_functions.models import OV_MODEL_CACHE
    from nncf.parameters import CompressWeightsMode
    from nncf.quantization.algorithms.weight_compression.config import WeightCompressionConfig
    from nncf.quantization.algorithms.weight_compression.weight_lowering import compress_weight
    from nncf.tensor import Tensor

    if quantized.dtype not in (torch.float32, torch.float16):
        raise HfExportError(
            f"the weight {quantized.name!r} computes in {quantized.dtype}: the low-memory export quantizes float32 "
            "and float16 weights; export with dtype float32 or without low_memory",
            stage="save",
        )
    config = WeightCompressionConfig(mode=CompressWeightsMode(quantized.mode), group_size=quantized.group_size)
    weight = checkpoint.load(quantized.key, quantized.dtype)
    # As NNCF's OpenVINO backend reads a weight (`get_const_value_as_ov_tensor`): an ov.Tensor, so that the same
    # (OpenVINO-compiled) compression function runs.
    tensor = Tensor(ov.Tensor(weight.numpy()))
    with disable_results_caching(OV_MODEL_CACHE):
        result = compress_weight(tensor, (quantized.axis,), config)
    element_type = getattr(ov.Type, quantized.element_type)
    consts = {"": create_ov_const_from_tensor(result.tensor, element_type)}
    consts["/scale"] = create_ov_const_from_tensor(result.scale, ov.Type.f16)
    if result.zero_point is not None:
        consts["/zero_point"] = create_ov_const_from_tensor(result.zero_point, element_type)
    del weight, tensor, result
    return {suffix: _bytes(const) for suffix, const in consts.items()}


def _bytes(const: Any) -> bytes:
    # The Constant's own buffer as OpenVINO's writer stores it: `data` is a numpy view of it (4-bit types packed
    # two to a byte, as uint8); `bytes_data` refuses 4-bit types.
    view = const.get_tensor_view()
    blob = view.data.tobytes()
    if len(blob) != view.byte_size:
        raise HfExportError(f"a {view.element_type} constant gave {len(blob)} of {view.byte_size} bytes", stage="save")
    return blob


class QuantizedWriter:
    """The bytes of each Const NNCF computed from a streamed weight, for `_write_streamed` and the check: the
    weight is compressed once, when its first Const is asked for, and kept until its last Const is taken."""

    def __init__(self, consts: Mapping[str, tuple[QuantizedWeight, str]], checkpoint: Checkpoint) -> None:
        self.consts = consts
        self.checkpoint = checkpoint
        self._pending: dict[str, dict[str, bytes]] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.consts

    def chunks(self, name: str) -> Iterator[bytes]:
        quantized, suffix = self.consts[name]
        blobs = self._pending.get(quantized.name)
        if blobs is None:
            blobs = self._pending[quantized.name] = compress(quantized, self.checkpoint)
        if suffix not in blobs:
            raise HfExportError(
                f"the Const {name!r}: NNCF computes no {suffix or 'compressed weight'} for this weight from the "
                "checkpoint, though the IR has one",
                stage="save",
            )
        blob = blobs.pop(suffix)
        if not any(s in quantized.parts for s in blobs):
            del self._pending[quantized.name]
        yield blob
