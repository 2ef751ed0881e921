"""Built-in tiny models, built from config with fixed seeds, so the CLI and docs work offline.

They have random weights: use them to try the pipeline, not to judge output quality.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_COMMON = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


@dataclass(frozen=True)
class TinyModel:
    name: str
    model_type: str
    config: dict[str, Any]
    auto_class: str = "AutoModelForCausalLM"
    description: str = ""
    sample_shape: tuple[int, int] = field(default=(2, 8))

    def build(self, seed: int = 0) -> Any:
        import torch
        import transformers
        from transformers import CONFIG_MAPPING

        config = CONFIG_MAPPING[self.model_type](**self.config)
        torch.manual_seed(seed)
        return getattr(transformers, self.auto_class).from_config(config).eval()

    def sample_inputs(self, seed: int = 0) -> dict[str, Any]:
        import torch

        generator = torch.Generator().manual_seed(seed)
        batch, length = self.sample_shape
        ids = torch.randint(3, self.config["vocab_size"], (batch, length), generator=generator)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


TINY_MODELS: dict[str, TinyModel] = {
    m.name: m
    for m in (
        TinyModel("tiny-llama", "llama", dict(_COMMON), description="Llama decoder, GQA, RoPE"),
        TinyModel(
            "tiny-qwen3-moe",
            "qwen3_moe",
            {**_COMMON, "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "head_dim": 8},
            description="Qwen3 mixture of experts",
        ),
        TinyModel(
            "tiny-gpt2",
            "gpt2",
            {
                "vocab_size": 128,
                "n_embd": 32,
                "n_layer": 2,
                "n_head": 4,
                "n_positions": 256,
                "bos_token_id": 1,
                "eos_token_id": 2,
            },
            description="GPT-2, learned positions",
        ),
    )
}


def get_tiny_model(name: str) -> TinyModel:
    try:
        return TINY_MODELS[name]
    except KeyError:
        raise KeyError(f"no built-in model {name!r}; built-ins: {', '.join(TINY_MODELS)}") from None
