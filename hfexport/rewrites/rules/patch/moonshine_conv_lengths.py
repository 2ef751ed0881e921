"""Moonshine: the encoder's mask length is computed with float division and `int()` from the audio length."""

from __future__ import annotations

from typing import Any

import torch

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, MethodPatch
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules._coverage_gaps import XNNPACK_RESHAPE


def feat_extract_output_lengths(original: Any, self: torch.nn.Module, input_lengths: Any) -> Any:
    """The conv stack's output length with integer floor division, for a symbolic audio length only.

    The original computes `int((length - 127) / 64 + 1)` and so on per conv: `int()` of a symbolic float
    makes torch.export specialise on the sample's length. Every conv needs its input at least as long as
    its kernel (127, 7, 3 samples), so wherever the encoder runs each numerator is >= 0, and truncation
    equals floor division (for lengths where it does not, 191 to 510 samples, conv2 gets fewer samples than
    its kernel and the encoder fails before this length is used); the result is then the same expression
    as the convs' output length.
    """
    if not isinstance(input_lengths, torch.SymInt):
        return NOT_APPLICABLE  # a concrete length (or a tensor of lengths): the original is exact
    output_conv1_length = (input_lengths - 127) // 64 + 1
    output_conv2_length = (output_conv1_length - 7) // 3 + 1
    output_conv3_length = (output_conv2_length - 3) // 2 + 1
    # The encoder slices `mask[..., ::384][..., :length]`. The conv length never exceeds the strided mask's
    # `ceil(length / 384)`, but the tracer cannot prove it and would guard on the sample's side of it; the
    # `min` with that bound keeps the value and lets the slice be traced without a guard.
    return torch.sym_min(output_conv3_length, (input_lengths + 383) // 384)


def _encoder() -> Any:
    from transformers import MoonshineConfig, MoonshineModel

    torch.manual_seed(0)
    config = MoonshineConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        encoder_num_hidden_layers=1,
        decoder_num_hidden_layers=1,
        encoder_num_attention_heads=2,
        decoder_num_attention_heads=2,
    )
    return MoonshineModel(config).get_encoder().eval()


def _inputs(length: int, padded: int, seed: int = 0) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    mask = torch.ones(2, length, dtype=torch.long)
    if padded:
        mask[1, -padded:] = 0
    return {"input_values": torch.randn(2, length, generator=generator), "attention_mask": mask}


moonshine_conv_lengths = MethodPatch(
    RuleMeta(
        id="patch/moonshine-conv-lengths",
        why="Moonshine's encoder exports for the sample's audio length only: the length of its downsampled "
        "mask is `int()` of a float division of the input length",
        upstream="transformers==5.24.0 models/moonshine/modeling_moonshine.py "
        "MoonshinePreTrainedModel._get_feat_extract_output_lengths",
        models=("moonshine",),
        examples=(
            Match(
                lambda: (_encoder(), _inputs(2000, padded=700)),
                "2000 samples with a padded tail, then 3333 samples",
                other_inputs=lambda: _inputs(3333, padded=0, seed=1),
                # OpenVINO: the replacement's sym_min and floor divisions, and the padded tail's fully masked rows.
                needs=(
                    "openvino/sym-min-max-to-floordiv",
                    "openvino/exact-int-floor-divide",
                    "openvino/sdpa-fully-masked-rows",
                ),
                known_failure={"executorch": XNNPACK_RESHAPE},
            ),
            NoMatch(
                lambda: (_encoder(), _inputs(2000, padded=700)),
                "2000 samples, exported static",
                reason="the replacement declines a concrete length: the original's int() of it is exact",
            ),
        ),
    ),
    target="transformers.models.moonshine.modeling_moonshine.MoonshinePreTrainedModel._get_feat_extract_output_lengths",
    replacement=feat_extract_output_lengths,
)
