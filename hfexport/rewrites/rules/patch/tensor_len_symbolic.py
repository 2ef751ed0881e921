"""`len(tensor)` as the tensor's first size, so a symbolic batch stays symbolic (the RT-DETR family).

Python's `len()` must return an `int`, so `len(t)` of a tensor whose first axis is symbolic makes torch.export
specialise that axis to the sample's size. The RT-DETR decoders take the batch as `batch_size = len(source_flatten)`
in their model forward (rt_detr, rt_detr_v2, d_fine, deimv2, pp_doclayout_v2/v3: the modules in which
`len(source_flatten)` occurs in transformers 5.24), so they exported for the sample's batch only ('Guard failed:
pixel_values.size()[0] == 2' at batch 3) though every image size passed.

The rule shadows the builtin `len` in those modeling modules, while exporting only: a tensor with at least one axis
whose first size is symbolic gets that size (`t.shape[0]`, the very number `len` returns); every other argument
(lists, tuples, a concrete size) declines to the builtin.
"""

from __future__ import annotations

from typing import Any

import torch

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, ModuleFunctionPatch
from hfexport.rewrites.rule import RuleMeta

# The modeling modules that take a batch as `len(source_flatten)` (grep over transformers 5.24's modeling files).
_MODULES = ("rt_detr", "rt_detr_v2", "d_fine", "deimv2", "pp_doclayout_v2", "pp_doclayout_v3")


def tensor_len(original: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
    if args or kwargs or not isinstance(obj, torch.Tensor) or obj.ndim == 0:
        return NOT_APPLICABLE
    first = obj.shape[0]
    if not isinstance(first, torch.SymInt):
        return NOT_APPLICABLE  # a concrete size: the builtin's int is the same number
    # Changed: the first size itself, which `len` would have turned into the sample's int.
    return first


def _detector() -> Any:
    from transformers import RTDetrConfig, RTDetrForObjectDetection, RTDetrResNetConfig

    torch.manual_seed(0)
    backbone = RTDetrResNetConfig(
        embedding_size=8,
        hidden_sizes=[8, 16, 16, 16],
        depths=[1, 1, 1, 1],
        layer_type="basic",
        out_features=["stage2", "stage3", "stage4"],
    )
    config = RTDetrConfig(
        backbone_config=backbone,
        encoder_in_channels=[16, 16, 16],
        encoder_hidden_dim=16,
        encoder_ffn_dim=16,
        encoder_attention_heads=2,
        d_model=16,
        decoder_in_channels=[16, 16, 16],
        decoder_ffn_dim=16,
        decoder_attention_heads=2,
        decoder_layers=1,
        decoder_n_points=2,
        num_queries=6,
        num_labels=2,
        anchor_image_size=None,
    )
    return RTDetrForObjectDetection(config).eval()


def _images(batch: int, seed: int = 0) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(batch, 3, 64, 64, generator=generator)}


tensor_len_symbolic = ModuleFunctionPatch(
    RuleMeta(
        id="patch/tensor-len-symbolic",
        why="the RT-DETR family (rt_detr, rt_detr_v2, d_fine, deimv2, pp_doclayout_v3) exported for the sample's "
        "batch only ('Guard failed: pixel_values.size()[0] == 2' at batch 3): the model forward takes "
        "`batch_size = len(source_flatten)`, and `len()` of a tensor specialises its symbolic first axis",
        upstream="transformers==5.24.0 models/rt_detr/modeling_rt_detr.py RTDetrModel.forward (`batch_size = "
        "len(source_flatten)`), copied to rt_detr_v2, d_fine, deimv2, pp_doclayout_v2, pp_doclayout_v3; "
        "Python requires `__len__` to return an int",
        # Measured 2026-12-03 on the example with batch and image size dynamic: ExecuTorch refuses it ('XNNPACK
        # reshape only supports 1 dynamic dimension'), and the ONNX and OpenVINO runs fail too (not examined yet);
        # the rule is enabled where it is proven (the five corpus detectors, every shape, on Dynamo).
        backends=("dynamo",),
        models=_MODULES,
        examples=(
            Match(
                lambda: (_detector(), _images(2)),
                "RT-DETR detector, batch 2 of 64x64 images, then batch 3",
                other_inputs=lambda: _images(3, seed=1),
            ),
            NoMatch(
                lambda: (_detector(), _images(2)),
                "the RT-DETR detector exported static",
                reason="a concrete batch: `len` keeps its int (and lists, tuples are never tensors)",
            ),
        ),
    ),
    target=tuple(f"transformers.models.{name}.modeling_{name}.len" for name in _MODULES),
    replacement=tensor_len,
    shadows_builtin=True,
)
