"""HunYuan-VL: the image placeholder check compares a boolean-mask selection's size in Python."""

from __future__ import annotations

from typing import Any

import torch

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, MethodPatch
from hfexport.rewrites.rule import RuleMeta


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


class _Merge(torch.nn.Module):
    """HunYuan-VL's merge step: image features scattered into the embeddings at the placeholder tokens."""

    def __init__(self, with_features: bool = True) -> None:
        super().__init__()
        from transformers import HunYuanVLConfig, HunYuanVLModel

        # Without features, the mask is asked for alone (no count to check), as for embeddings-only inputs.
        self.with_features = with_features

        small = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
        text = {**small, "vocab_size": 32, "num_key_value_heads": 2, "head_dim": 8}
        vision = {**small, "num_key_value_heads": 2, "out_hidden_size": 16, "text_hidden_size": 16}
        config = HunYuanVLConfig(text_config=text, vision_config=vision, image_token_id=5)
        self.model = HunYuanVLModel(config)

    def forward(self, input_ids: torch.Tensor, image_features: torch.Tensor) -> torch.Tensor:
        embeds = self.model.get_input_embeddings()(input_ids)
        if not self.with_features:
            mask = self.model.get_placeholder_mask(input_ids, embeds)
            return embeds.masked_fill(mask, 0.0) + image_features.sum()
        mask = self.model.get_placeholder_mask(input_ids, embeds, image_features)
        return embeds.masked_scatter(mask, image_features)


def _merge(with_features: bool = True) -> tuple[torch.nn.Module, dict[str, Any]]:
    torch.manual_seed(0)
    ids = torch.tensor([[1, 5, 5, 5, 7, 8], [1, 9, 5, 5, 5, 2]])
    return _Merge(with_features).eval(), {"input_ids": ids, "image_features": torch.randn(6, 16)}


hunyuan_vl_placeholder_check = MethodPatch(
    RuleMeta(
        id="patch/hunyuan-vl-placeholder-check",
        why="HunYuan-VL checks `inputs_embeds[mask].numel() != image_features.numel()` in Python: the size of a "
        "boolean-mask selection is data-dependent, and torch.export fails on the branch ('Could not guard on "
        "data-dependent expression Ne(u0, 2816)'); the same check as a traceable torch._check keeps the mask "
        "and the error for mismatched inputs",
        upstream="transformers==5.24.0 models/hunyuan_vl/modeling_hunyuan_vl.py HunYuanVLModel.get_placeholder_mask "
        "(LLaVA's uses torch_compilable_check)",
        models=("hunyuan_vl",),
        examples=(
            # torch_compilable_check's all() of a boolean lowers only with aten/is-all-true on ONNX and
            # executorch/is-all-true-as-any on ExecuTorch.
            Match(
                _merge,
                "two rows with three image tokens each",
                needs=("aten/is-all-true", "executorch/is-all-true-as-any"),
            ),
            NoMatch(
                lambda: _merge(with_features=False),
                "the placeholder mask asked for without image features",
                reason="the replacement declines a call without image features: there is no count to check",
            ),
        ),
    ),
    target="transformers.models.hunyuan_vl.modeling_hunyuan_vl.HunYuanVLModel.get_placeholder_mask",
    replacement=placeholder_mask,
)
