"""Tiny Longformer models and inputs: the examples of the Longformer patches (`patch/longformer-attention-dense`,
`patch/longformer-pad-always`)."""

from __future__ import annotations

from typing import Any

import torch


def longformer_example(kind: str = "model") -> torch.nn.Module:
    """A two-layer Longformer (windows 4 and 8) in eval mode, or its sequence classifier (`kind="classifier"`)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LongformerConfig(
        vocab_size=64,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        attention_window=[4, 8],
        max_position_embeddings=160,
        pad_token_id=1,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    if kind == "classifier":
        return transformers.LongformerForSequenceClassification(config).eval()
    return transformers.LongformerModel(config, add_pooling_layer=False).eval()


def longformer_inputs(batch: int, length: int, pad: int, globals_at: tuple[int, ...]) -> dict[str, Any]:
    """Token ids with `pad` trailing padding tokens in the last row and global attention at `globals_at` of row 0
    (row 1, if any, has none): rows with several, one and no global tokens, and padding."""
    ids = torch.randint(3, 64, (batch, length), generator=torch.Generator().manual_seed(length))
    mask = torch.ones(batch, length, dtype=torch.long)
    if pad:
        ids[-1, length - pad :] = 1
        mask[-1, length - pad :] = 0
    global_mask = torch.zeros(batch, length, dtype=torch.long)
    global_mask[0, list(globals_at)] = 1
    if batch > 2:
        global_mask[2, 0] = 1
    return {"input_ids": ids, "attention_mask": mask, "global_attention_mask": global_mask}


def roberta_example() -> tuple[torch.nn.Module, dict[str, Any]]:
    """RoBERTa, whose embeddings Longformer shares: a model the Longformer patches do not apply to."""
    import transformers

    torch.manual_seed(0)
    config = transformers.RobertaConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32
    )
    inputs = longformer_inputs(2, 9, pad=2, globals_at=(0,))
    inputs.pop("global_attention_mask")
    return transformers.RobertaModel(config, add_pooling_layer=False).eval(), inputs
