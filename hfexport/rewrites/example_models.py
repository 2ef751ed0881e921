"""Tiny models for rule examples, built from config with fixed seeds (nothing is downloaded)."""

from __future__ import annotations

from typing import Any

import torch

from hfexport.rewrites.examples import Built


def token_inputs(batch: int, tokens: int, vocab: int = 64, seed: int = 1) -> dict[str, Any]:
    """Forward kwargs of a batch of random token ids, without a cache (rules are about one forward)."""
    generator = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, vocab, (batch, tokens), generator=generator), "use_cache": False}


def tiny_model(config_class: str, model_class: str, tokens: int, batch: int = 2, **config: Any) -> Built:
    """`transformers.<model_class>(transformers.<config_class>(**config))` in eval mode, with token inputs."""
    import transformers

    torch.manual_seed(0)
    model = getattr(transformers, model_class)(getattr(transformers, config_class)(**config)).eval()
    return model, token_inputs(batch, tokens, vocab=config.get("vocab_size", 64), seed=0)


def dense_decoder() -> Built:
    """A one-layer Llama: the usual NoMatch model for rules about other architectures."""
    return tiny_model(
        "LlamaConfig",
        "LlamaModel",
        tokens=5,
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )


def sliding_mistral(window: int, attention: str = "sdpa") -> torch.nn.Module:
    """A two-layer Mistral causal LM (fixed seed) whose every layer attends through a `window`-token sliding window:
    the sliding-window cache rules' examples and tests."""
    import transformers

    torch.manual_seed(0)
    config = transformers.MistralConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=window,
        max_position_embeddings=256,
        attn_implementation=attention,
    )
    return transformers.MistralForCausalLM(config).eval()


def left_padded_llama(tokens: int = 6, padded: int = 3, head_dim: int | None = None) -> Built:
    """A Llama (GQA) whose first row is left-padded by `padded` tokens: the OpenVINO attention rules' examples;
    `head_dim` gives one layer of 2 query heads on 1 kv head at that width."""
    # use_cache=False in the config, not as a kwarg: no cache to build and no constant input to convert.
    width = {"hidden_size": 16, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2}
    if head_dim is not None:
        width = {"hidden_size": 2 * head_dim, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": head_dim}
        width["num_hidden_layers"] = 1
    model, inputs = tiny_model(
        "LlamaConfig", "LlamaModel", tokens=tokens, vocab_size=64, intermediate_size=32, use_cache=False, **width
    )
    ids = inputs["input_ids"]
    mask = torch.ones_like(ids)
    mask[0, :padded] = 0
    return model, {"input_ids": ids, "attention_mask": mask}
