"""Sliding-window mask sizes from a symbolic token counter, without branching on it.

transformers' `DynamicSlidingWindowLayer.get_mask_sizes` computes the attention mask's key length and offset from
the layer's token counter `cumulative_length` with Python: `is_full = cumulative_length >= sliding_window` picks
`window - 1 + q` or `cumulative_length + q`, and `max(cumulative_length - window + 1, 0)` is the offset. On the
generation path the counter is a graph input (hfexport's cache pytree carries it as the size of an empty leaf), so
it is a SymInt while tracing: the branch and `max` are decided on the sample's counter (before the window, as a
generation sample always is) and guard on it, and the decode program refused every step past the window.

The replacement computes the same two numbers with `torch.sym_min`/`torch.sym_max`: since the layer keeps the last
`window - 1` tokens, the key length is `min(count, window - 1) + q` in both branches and the offset is
`max(count - window + 1, 0)`, exactly the original's values for every count (before, at and past the window). A
layer that holds keys (a decode step) has kept exactly `min(count, window - 1)` of them, so there the key length is
read off the keys and the offset is `count - kept`: the same numbers with no `Min`/`Max`, which torch resolved on the
sample when a trace equated the mask with the keys (lara_mini's hybrid decode, `Eq(Min(15, count) + 1, keys + 1)`,
guarded `count < 15`). It runs only where the counter is symbolic; a number takes the original's code. Matched by
structure: any cache layer class that inherits this method unchanged (Mistral, Gemma2/3, Cohere2, gpt-oss, ...),
whatever the model.
"""

from __future__ import annotations

from typing import Any

import torch

from hfexport.rewrites.examples import NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, ModuleFunctionPatch
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.patch._sliding_window import (
    examples_past_the_window,
    static_example,
    uses_sliding_layer_method,
)

_TARGET = "transformers.cache_utils.DynamicSlidingWindowLayer.get_mask_sizes"


def get_mask_sizes(original: Any, layer: Any, query_length: Any) -> Any:
    count, window = layer.cumulative_length, layer.sliding_window
    if not isinstance(count, torch.SymInt) or not isinstance(window, int) or window < 1:
        return NOT_APPLICABLE
    # Changed: `is_full ? window - 1 + q : count + q` is `min(count, window - 1) + q` (count < window means
    # count <= window - 1), and `max(...)` is `sym_max`: no guard on the counter.
    kv_offset = torch.sym_max(count - window + 1, 0)
    kept = torch.sym_min(count, window - 1)
    keys = getattr(layer, "keys", None)
    if getattr(layer, "is_initialized", False) and isinstance(keys, torch.Tensor) and keys.ndim == 4:
        # The layer keeps the last `window - 1` tokens, so its kept keys are `min(count, window - 1)` long: the
        # same number, read off the keys. The mask is then sized like the keys it masks by construction; sized by
        # the `Min`, a trace that equates the two (lara_mini's hybrid decode: `Eq(Min(15, count) + 1, keys + 1)`)
        # made torch resolve the `Min` on the sample into the guard `count < 15`.
        # Likewise the offset `max(count - window + 1, 0)` is `count - kept`, with no `Max` to resolve.
        kept = keys.shape[-2]
        kv_offset = count - kept
    kv_length = kept + query_length
    return kv_length, kv_offset


def _applies(model: torch.nn.Module) -> bool:
    return uses_sliding_layer_method(model, "get_mask_sizes")


sliding_window_mask_sizes_symbolic = ModuleFunctionPatch(
    RuleMeta(
        id="patch/sliding-window-mask-sizes-symbolic",
        why="a decode step exported with a sliding-window cache whose token counter is a graph input (a SymInt) "
        "took the sample's branch of `is_full = cumulative_length >= sliding_window` and of `max(...)` and "
        "guarded on it: generation stopped at the window (17 causal-LM types: mistral, gemma3_text, cohere2, ...)",
        upstream="transformers==5.24.0 cache_utils.py DynamicSlidingWindowLayer.get_mask_sizes (Python branch "
        "and max on `self.cumulative_length`)",
        # Generation past the window is measured on these two (tests/test_generation.py); ExecuTorch and OpenVINO
        # generation past the window is not checked yet.
        backends=("dynamo", "onnx"),
        models=("mistral", "gemma3_text", "cohere2", "granite_swa", "vaultgemma", "lara_mini"),
        examples=(
            *examples_past_the_window(needs=("patch/sliding-window-cache-symbolic", "patch/sdpa-causal-skip-traced")),
            NoMatch(static_example, "exported static past the window", reason="the counter is a number"),
        ),
    ),
    target=_TARGET,
    replacement=get_mask_sizes,
    applies=_applies,
)
