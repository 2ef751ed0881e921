"""LongT5: block-local attention pads the sequence to whole blocks only when it is not a multiple already."""

from __future__ import annotations

from typing import Any

import torch

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, ModuleFunctionPatch
from hfexport.rewrites.rule import RuleMeta, ScanCause
from hfexport.rewrites.rules._coverage_gaps import XNNPACK_RESHAPE


def split_into_blocks(original: Any, x: torch.Tensor, block_len: int, dim: int) -> Any:
    """`_split_into_blocks` that always pads, by 1 to `block_len` elements: one block more when the length
    is a multiple of `block_len` already.

    The original pads only when `length % block_len != 0`, a guard on the sample's length; and whether it
    padded decides whether the attention's `attn_output[:, :seq_length]` is a contiguous view, another guard.
    With at least one padded element both are the same for every length. The extra block is padding as
    the original's: zeros in the keys and values and 0 in the split attention mask (masked with -1e10, as
    the zero blocks `_concatenate_3_blocks` adds at the ends), and its query rows are sliced off by the
    attention, so every real position computes the same scores and outputs.
    """
    if any(isinstance(size, int) and size == 0 for size in x.shape):
        return NOT_APPLICABLE  # an empty input: the original's zeros / torch.empty branches
    num_blocks = x.shape[dim] // block_len + 1
    pad = [(0, 0)] * x.ndim
    pad[dim] = (0, num_blocks * block_len - x.shape[dim])
    x = torch.nn.functional.pad(x, pad=sum(pad[::-1], ()), mode="constant", value=0)
    output_shape = (*x.shape[:dim], num_blocks, block_len, *x.shape[dim + 1 :])
    return x.reshape(output_shape)


def _longt5(attention: str) -> Any:
    from transformers import LongT5Config, LongT5EncoderModel

    torch.manual_seed(0)
    config = LongT5Config(
        vocab_size=64,
        d_model=16,
        d_kv=8,
        d_ff=32,
        num_layers=1,
        num_heads=2,
        local_radius=2,
        global_block_size=3,
        relative_attention_num_buckets=8,
        encoder_attention_type=attention,
    )
    return LongT5EncoderModel(config).eval()


def _decoder() -> tuple[Any, dict[str, Any]]:
    """LongT5's decoder stack: full self-attention and cross-attention, no block-local attention."""
    from transformers import LongT5Config, LongT5Model

    torch.manual_seed(0)
    config = LongT5Config(
        vocab_size=64, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2, relative_attention_num_buckets=8
    )
    decoder = LongT5Model(config).get_decoder().eval()
    generator = torch.Generator().manual_seed(0)
    return decoder, {
        "input_ids": torch.randint(2, 64, (2, 5), generator=generator),
        "encoder_hidden_states": torch.randn(2, 7, 16, generator=generator),
        "use_cache": False,
    }


def _inputs(length: int, padded: bool, seed: int = 0) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    mask = torch.ones(2, length, dtype=torch.long)
    if padded:
        mask[1, :2] = 0
    return {"input_ids": torch.randint(2, 64, (2, length), generator=generator), "attention_mask": mask}


longt5_pad_blocks = ModuleFunctionPatch(
    RuleMeta(
        id="patch/longt5-pad-blocks",
        why="LongT5's encoder exports with a guard `seq_len % block_len != 0` from the sample: "
        "`_split_into_blocks` pads to whole blocks only when the length is not a multiple",
        upstream="transformers==5.24.0 models/longt5/modeling_longt5.py _split_into_blocks",
        scan=(
            ScanCause(
                "block-padding",
                "size-modulo",
                "_split_into_blocks",
                "LongT5 pads to whole blocks only when `L % block != 0`: a guard on the sample's remainder",
            ),
        ),
        models=("longt5",),
        examples=(
            Match(
                lambda: (_longt5("local"), _inputs(7, padded=True)),
                "local attention, 7 tokens (padded to 3 blocks of 3), then 9 tokens (a multiple)",
                other_inputs=lambda: _inputs(9, padded=False, seed=1),
                known_failure={"executorch": XNNPACK_RESHAPE},
            ),
            Match(
                lambda: (_longt5("transient-global"), _inputs(8, padded=True)),
                "transient-global attention, 8 tokens with a left-padded row (padded by 1)",
            ),
            NoMatch(
                _decoder,
                "LongT5's decoder",
                reason="the gate is installed (a LongT5 model), but the decoder's full attention never splits "
                "into blocks",
            ),
        ),
    ),
    target="transformers.models.longt5.modeling_longt5._split_into_blocks",
    replacement=split_into_blocks,
)
