"""ProphetNet decode step: its position id from the cache length without an `int()` cast.

`ProphetNetPositionalEmbeddings.forward` gives a decode step (a cache that is not empty) the position
`padding_idx + past + tokens`, built as `torch.ones((1, 1)) * int(self.padding_idx + num_input_ids)`. Under
torch.export the cache length is symbolic, and `int()` of it specialises it to the sample's: the decode program
fails `Guard failed: 1 + past_key_values.layers_0_keys.size()[2] == 9` at the next step. Multiplying by the
symbolic integer itself gives the same int64 value at every length. The prompt branch (no cache or an empty
one) is upstream's, unchanged.
"""

from __future__ import annotations

from typing import Any

import torch

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, MethodPatch
from hfexport.rewrites.rule import RuleMeta


def decode_positions(
    original: Any,
    self: torch.nn.Module,
    inputs_shape: Any,
    device: Any,
    attention_mask: torch.Tensor | None = None,
    cache: Any = None,
    position_ids: torch.Tensor | None = None,
) -> Any:
    if position_ids is not None or cache is None:
        return NOT_APPLICABLE
    past = cache.get_seq_length()
    if not isinstance(past, torch.SymInt):
        return NOT_APPLICABLE  # a concrete length: upstream's int() is exact
    if past == 0:  # the prompt branch (upstream's own test; a decode graph keeps it as its guard past >= 1)
        return NOT_APPLICABLE
    num_input_ids = inputs_shape[1] + past
    # Upstream: torch.ones((1, 1)) * int(padding_idx + num_input_ids); the same value, kept symbolic.
    position_ids = torch.ones((1, 1), dtype=torch.long, device=device) * (self.padding_idx + num_input_ids)
    return torch.nn.Embedding.forward(self, position_ids), position_ids


class _PromptThenStep(torch.nn.Module):
    """The prompt (whose length is the graph's symbolic length), then one decode step on the cache it filled:
    the step's logits depend on its position, so they show a wrong or specialised position id."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        prompt = self.model(input_ids=input_ids, use_cache=True)
        return self.model(input_ids=next_ids, past_key_values=prompt.past_key_values, use_cache=True).logits


def _prophetnet(tokens: int, batch: int = 2) -> tuple[torch.nn.Module, dict[str, Any]]:
    from transformers import ProphetNetConfig, ProphetNetForCausalLM

    torch.manual_seed(0)
    config = ProphetNetConfig(
        vocab_size=64,
        hidden_size=16,
        decoder_ffn_dim=32,
        num_decoder_layers=1,
        num_decoder_attention_heads=2,
        encoder_ffn_dim=32,
        num_encoder_layers=1,
        num_encoder_attention_heads=2,
        ngram=2,
        num_buckets=8,
        relative_max_distance=16,
        max_position_embeddings=64,
    )
    model = ProphetNetForCausalLM(config).eval()
    generator = torch.Generator().manual_seed(tokens)
    ids = torch.randint(3, 64, (batch, tokens), generator=generator)
    return _PromptThenStep(model).eval(), {"input_ids": ids, "next_ids": torch.randint(3, 64, (batch, 1))}


prophetnet_decode_positions_symbolic = MethodPatch(
    RuleMeta(
        id="patch/prophetnet-decode-positions-symbolic",
        why="ProphetNet's decode step exports with the cache length baked in: "
        "`ProphetNetPositionalEmbeddings.forward` casts `int(self.padding_idx + num_input_ids)` for the step's "
        "position, so the program fails 'Guard failed: 1 + past_key_values.layers_0_keys.size()[2] == 9' at the "
        "next step (Dynamo); on ONNX the step keeps the sample's length in its position arithmetic and ONNX "
        "Runtime fails in an Add ('Attempting to broadcast an axis by a dimension other than 1. 5 by 9', the "
        "example's 9-token prompt; causal_lm/prophetnet's ONNX generation at its first decode step)",
        upstream="transformers==5.24.0 models/prophetnet/modeling_prophetnet.py ProphetNetPositionalEmbeddings.forward "
        "(the int() cast is there for the old TorchScript ONNX exporter)",
        # The cause is not backend-specific; ExecuTorch and OpenVINO are not measured (2026-12-03): it is
        # enabled where proven. ONNX got that far once `aten/is-all-true` and `fx/split-symbolic-size-as-sizes`
        # let ProphetNet translate.
        backends=("dynamo", "onnx"),
        models=("prophetnet",),
        examples=(
            Match(
                lambda: _prophetnet(5),
                "a 5-token prompt and one step, then a 9-token prompt and another batch",
                other_inputs=lambda: _prophetnet(9, batch=3)[1],
                # ONNX: ProphetNet's position check (aten._is_all_true), its additive mask (rsub of an int64
                # mask) and its n-gram chunks (a symbolic split) have their own rules.
                needs=("aten/is-all-true", "fx/rsub-promoted-scalar", "fx/split-symbolic-size-as-sizes"),
            ),
            NoMatch(
                lambda: _prophetnet(5),
                "exported static",
                reason="the replacement declines a concrete cache length: upstream's int() is exact there",
            ),
        ),
    ),
    target="transformers.models.prophetnet.modeling_prophetnet.ProphetNetPositionalEmbeddings.forward",
    replacement=decode_positions,
)
