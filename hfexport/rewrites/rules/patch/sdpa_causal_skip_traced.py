"""The SDPA mask's "can the causal mask be skipped?" check, answered before it slices by a symbolic window.

transformers' `masking_utils._ignore_causal_mask_sdpa` starts by cutting the 2-D padding mask down to the keys the
layer attends to (`if padding_mask.shape[-1] > kv_length: padding_mask = padding_mask[:, arange(kv_length) +
kv_offset]`) and only then returns False because it is tracing or exporting: the cut is dead code there, but its
`if` compares the mask length with the key length. With a sliding-window cache whose counter is a graph input, the
key length is `min(count, window - 1) + q`, and a generation sample (before the window) decides the comparison
False: the program guards `attention_mask.size()[1] <= min(count, window - 1) + q` and refuses every decode step
past the window ("Guard failed: attention_mask.size()[1] <= 5").

The replacement returns False, the original's answer, as soon as the original would (exporting, or a padding mask
that is being traced), without the dead comparison; every other call runs the original. Matched by structure: it
is installed for models whose dynamic cache has a layer that inherits `DynamicSlidingWindowLayer.get_mask_sizes`
(the layers whose key length is below the mask's length), and runs only while tracing.
"""

from __future__ import annotations

from typing import Any

import torch

from hfexport.rewrites.examples import NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, ModuleFunctionPatch
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.patch._sliding_window import (
    eager_attention_example,
    examples_past_the_window,
    static_example,
    uses_sliding_layer_method,
)

_TARGET = "transformers.masking_utils._ignore_causal_mask_sdpa"


def ignore_causal_mask_sdpa(
    original: Any, padding_mask: Any, q_length: Any, kv_length: Any, *args: Any, **kwargs: Any
) -> Any:
    from transformers.utils.import_utils import is_torchdynamo_exporting, is_tracing

    # Only where the dead comparison would guard: a symbolic mask or key length (a number compares freely).
    mask_length = padding_mask.shape[-1] if padding_mask is not None else None
    if not any(isinstance(n, torch.SymInt) for n in (mask_length, kv_length)):
        return NOT_APPLICABLE
    # The original's own test, before its slicing: under export or with a traced mask it returns False.
    if is_torchdynamo_exporting() or (padding_mask is not None and is_tracing(padding_mask)):
        return False
    return NOT_APPLICABLE


def _applies(model: torch.nn.Module) -> bool:
    return uses_sliding_layer_method(model, "get_mask_sizes")


sdpa_causal_skip_traced = ModuleFunctionPatch(
    RuleMeta(
        id="patch/sdpa-causal-skip-traced",
        why="a decode step with a sliding-window cache whose counter is a graph input guarded on the sample's "
        "`padding_mask.shape[-1] > kv_length` in `_ignore_causal_mask_sdpa` (a comparison whose result is unused "
        "under export) and refused every step past the window ('Guard failed: attention_mask.size()[1] <= 5')",
        upstream="transformers==5.24.0 masking_utils.py _ignore_causal_mask_sdpa (slices the padding mask before "
        "its `is_torchdynamo_exporting()` early return)",
        # Generation past the window is measured on these two (tests/test_generation.py); ExecuTorch and OpenVINO
        # generation past the window is not checked yet.
        backends=("dynamo", "onnx"),
        models=("mistral", "gemma3_text", "cohere2", "granite_swa", "vaultgemma"),
        examples=(
            *examples_past_the_window(
                needs=("patch/sliding-window-cache-symbolic", "patch/sliding-window-mask-sizes-symbolic")
            ),
            NoMatch(static_example, "exported static past the window", reason="the mask and key lengths are numbers"),
            NoMatch(
                eager_attention_example,
                "eager attention",
                reason="the eager mask never asks whether the causal mask can be skipped",
            ),
        ),
    ),
    target=_TARGET,
    replacement=ignore_causal_mask_sdpa,
    applies=_applies,
)
