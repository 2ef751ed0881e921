"""HunYuan-VL's merge of image features into the embeddings: the example model of the rules its placeholder check
needs (`patch/hunyuan-vl-placeholder-check`, and `executorch/is-all-true-as-any` for the check it traces)."""

from __future__ import annotations

from typing import Any

import torch


class HunYuanVLMerge(torch.nn.Module):
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


def hunyuan_vl_merge(with_features: bool = True) -> tuple[torch.nn.Module, dict[str, Any]]:
    """The merge step on two rows of three image tokens each (with the image features, or without: the mask alone)."""
    torch.manual_seed(0)
    ids = torch.tensor([[1, 5, 5, 5, 7, 8], [1, 9, 5, 5, 5, 2]])
    return HunYuanVLMerge(with_features).eval(), {"input_ids": ids, "image_features": torch.randn(6, 16)}
