"""HunYuan-VL: the image placeholder check compares a boolean-mask selection's size in Python."""

from __future__ import annotations

from typing import Any

import torch

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, MethodPatch
from hfexport.rewrites.rule import RuleMeta, ScanCause
from hfexport.rewrites.rules._hunyuan_vl import hunyuan_vl_merge


def placeholder_mask(
    original: Any, self: torch.nn.Module, input_ids: Any, inputs_embeds: torch.Tensor, image_features: Any = None
) -> Any:
    """The same mask; the count check as a traceable `torch._check` instead of `if ... != ...: raise`.

    The original checks `inputs_embeds[mask].numel() != image_features.numel()`: the size of a boolean
    selection is data-dependent, so torch.export cannot branch on it. That size is the number of image
    tokens times the hidden size, which `torch_compilable_check` (transformers' own traceable check, as
    LLaVA's placeholder mask uses) asserts without a branch.
    """
    if input_ids is None or image_features is None:
        return NOT_APPLICABLE  # the embeddings-only path has no data-dependent branch to fix here
    from transformers.utils.import_utils import torch_compilable_check

    mask = input_ids == self.config.image_token_id
    torch_compilable_check(
        mask.sum() * inputs_embeds.shape[-1] == image_features.numel(),
        "Image features and image tokens do not match",
    )
    return mask.unsqueeze(-1).expand_as(inputs_embeds).to(inputs_embeds.device)


hunyuan_vl_placeholder_check = MethodPatch(
    RuleMeta(
        id="patch/hunyuan-vl-placeholder-check",
        why="HunYuan-VL checks `inputs_embeds[mask].numel() != image_features.numel()` in Python: the size of a "
        "boolean-mask selection is data-dependent, and torch.export fails on the branch ('Could not guard on "
        "data-dependent expression Ne(u0, 2816)'); the same check as a traceable torch._check keeps the mask "
        "and the error for mismatched inputs",
        upstream="transformers==5.24.0 models/hunyuan_vl/modeling_hunyuan_vl.py HunYuanVLModel.get_placeholder_mask "
        "(LLaVA's uses torch_compilable_check)",
        scan=(
            ScanCause(
                "placeholder-count-check",
                "masked-size-branch",
                ".*",
                "a Python check of `x[mask].numel()`: a data-dependent size export cannot guard on",
            ),
        ),
        models=("hunyuan_vl",),
        examples=(
            # torch_compilable_check's all() of a boolean lowers only with aten/is-all-true on ONNX and
            # executorch/is-all-true-as-any on ExecuTorch.
            Match(
                hunyuan_vl_merge,
                "two rows with three image tokens each",
                needs=("aten/is-all-true", "executorch/is-all-true-as-any"),
            ),
            NoMatch(
                lambda: hunyuan_vl_merge(with_features=False),
                "the placeholder mask asked for without image features",
                reason="the replacement declines a call without image features: there is no count to check",
            ),
        ),
    ),
    target="transformers.models.hunyuan_vl.modeling_hunyuan_vl.HunYuanVLModel.get_placeholder_mask",
    replacement=placeholder_mask,
)
