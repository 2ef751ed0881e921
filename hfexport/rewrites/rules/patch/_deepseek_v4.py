"""A tiny DeepSeek-V4 and its inputs: the examples of its patches (`patch/deepseek-v4-overlap-windows`,
`patch/deepseek-v4-window-buffer`)."""

from __future__ import annotations

from typing import Any

import torch

from hfexport.rewrites.examples import Built

# What the example model needs besides this rule: its MoE experts on ONNX (the grouped_mm custom op) and
# OpenVINO (histc), and on OpenVINO the symbolic min and floor divisions of the windows.
EXAMPLE_NEEDS = (
    "aten/grouped-mm-fallback",
    "patch/moe-batched-experts",
    "openvino/sym-min-max-to-floordiv",
    "openvino/exact-int-floor-divide",
)


def deepseek_v4_example(tokens: int, layer: str = "compressed_sparse_attention") -> Built:
    """A one-layer DeepSeek-V4 (CSA windows of 4) run on `tokens` tokens without a cache."""
    from transformers import DeepseekV4Config, DeepseekV4Model

    torch.manual_seed(0)
    config = DeepseekV4Config(
        vocab_size=64,
        hidden_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        q_lora_rank=16,
        n_routed_experts=2,
        num_experts_per_tok=1,
        n_shared_experts=1,
        layer_types=[layer],
        mlp_layer_types=["moe"],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
        sliding_window=8,
        o_groups=2,
        o_lora_rank=8,
        # The indexer scores an entry as a sum of per-head ReLUs, exactly 0 whenever every head is negative, and
        # keeps the top `index_topk` of them. With 2 heads a quarter of the entries tie at 0, and the order of
        # tied values in topk is unspecified: eager torch picks one set, ONNX Runtime and OpenVINO (lowest index
        # first) another, so longer inputs differed by ~0.1. With 8 heads a tie needs 1/256 odds twice over.
        index_n_heads=8,
        index_head_dim=16,
        index_topk=2,
        qk_rope_head_dim=8,
        max_position_embeddings=64,
    )
    model = DeepseekV4Model(config).eval()
    ids = torch.randint(3, 64, (2, tokens), generator=torch.Generator().manual_seed(tokens))
    return model, {"input_ids": ids, "use_cache": False}


def longer_inputs(tokens: int, batch: int = 2) -> dict[str, Any]:
    """Other token ids for the examples' second run."""
    ids = torch.randint(3, 64, (batch, tokens), generator=torch.Generator().manual_seed(100 + tokens))
    return {"input_ids": ids, "use_cache": False}
