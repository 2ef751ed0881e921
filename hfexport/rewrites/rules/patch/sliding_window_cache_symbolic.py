"""Sliding-window caches: keep the last `window - 1` tokens without a guard on the sample's length.

transformers' `DynamicSlidingWindowLayer.update` keeps `full_key_states[:, :, -sliding_window + 1 :, :]`.
Traced from a sample shorter than the window, torch's slice normalisation decides `-window + 1 + L < 0` on the
sample and records the guard `L <= window - 2`: the Dynamo program refuses longer inputs ("Guard failed:
input_ids.size()[1] <= 126" for gpt_oss, window 128, at 138 tokens), and ExecuTorch plans memory for at most
that length. ONNX programs keep no guards, so the sample's branch (keep everything) stays in the graph: past the
window the returned cache held every token (138 instead of 127 for gpt_oss) while the logits still matched, a
wrong cache that the next decode step reads. OpenVINO is not affected: its conversion keeps the negative start.

The replacement keeps the same tokens with `index_select` over `arange(L - min(L, window - 1), L)`, with
`torch.sym_min`: a fresh tensor, so no view of `full` exists whose contiguity torch's metadata would guard on
either (`narrow` or a `sym_max` start both guard `L == min(L, window - 1)`). It runs only where the length is
symbolic and the layer does not record its past; everything else is the original's code path. The rule is matched
by structure: any cache layer class that inherits this `update` unchanged (Mistral, Qwen2, Gemma2/3, Cohere2,
gpt-oss, Olmo3, ... and the linear-attention hybrids' sliding layers), whatever the model.
"""

from __future__ import annotations

from typing import Any

import torch

from hfexport.rewrites.example_models import sliding_mistral
from hfexport.rewrites.examples import Built, Match, NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, ModuleFunctionPatch
from hfexport.rewrites.rule import RuleMeta, ScanCause
from hfexport.rewrites.rules.patch._sliding_window import uses_sliding_layer_method

_TARGET = "transformers.cache_utils.DynamicSlidingWindowLayer.update"


def update(
    original: Any, layer: Any, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
) -> Any:
    window = layer.sliding_window
    # An initialised layer that holds nothing yet keeps a 1-D empty tensor (transformers' lazy initialisation).
    past = layer.keys.shape[-2] if layer.is_initialized and layer.keys.dim() >= 2 else 0
    length = past + key_states.shape[-2]
    # A static length slices exactly as the original; `record_past` (assisted decoding) keeps everything; a window
    # below 2 makes the original's start non-negative (window 1 keeps every token), a case left to it.
    if not isinstance(length, torch.SymInt) or layer.record_past or not isinstance(window, int) or window < 2:
        return NOT_APPLICABLE
    if not layer.is_initialized:
        layer.lazy_initialization(key_states, value_states)
    layer.cumulative_length += key_states.shape[-2]
    full_key_states = torch.cat([layer.keys, key_states], dim=-2)
    full_value_states = torch.cat([layer.values, value_states], dim=-2)
    # Changed: `full[:, :, -window + 1 :, :]` as an index_select of the last min(L, window - 1) positions.
    kept = torch.sym_min(length, window - 1)
    positions = torch.arange(length - kept, length, device=full_key_states.device)
    layer.keys = full_key_states.index_select(-2, positions)
    layer.values = full_value_states.index_select(-2, positions)
    return full_key_states, full_value_states


def _uses_sliding_cache(model: torch.nn.Module) -> bool:
    return uses_sliding_layer_method(model, "update")


_WINDOW = 8


class _WithCache(torch.nn.Module):
    """A causal LM whose outputs are its logits and every cache layer's keys and values, so that the examples
    compare the kept window with eager's (a cache object's tensors are not leaves of an eager output tree)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.config = model.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=True)
        cache = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
        return (out.logits, *cache)


def _mistral(tokens: int, padded: bool = False) -> Built:
    """A two-layer Mistral with an 8-token window and its cache as outputs; `padded` left-pads the second row."""
    model = sliding_mistral(_WINDOW)
    return _WithCache(model).eval(), _inputs(tokens, padded=padded)


def _inputs(tokens: int, batch: int = 2, padded: bool = False) -> dict[str, Any]:
    ids = torch.randint(3, 64, (batch, tokens), generator=torch.Generator().manual_seed(tokens + batch))
    mask = torch.ones_like(ids)
    if padded:
        # More padding than the window: the padded positions' query rows are fully masked.
        mask[1, : min(tokens - 1, _WINDOW + 3)] = 0
    return {"input_ids": ids, "attention_mask": mask}


# Fully masked query rows (the padded positions) need the SDPA fix on ONNX (below opset 23).
_NEEDS = ("aten/sdpa-fully-masked-rows",)


def _static_mistral() -> Built:
    return _mistral(5)


sliding_window_cache_symbolic = ModuleFunctionPatch(
    RuleMeta(
        id="patch/sliding-window-cache-symbolic",
        why="a model with sliding-window attention exported from a sample shorter than its window refused longer "
        "inputs on Dynamo ('Guard failed: input_ids.size()[1] <= 126', gpt_oss at 138 tokens) and ExecuTorch "
        "(planned for at most window - 2 tokens), and on ONNX returned a cache of every token instead of the last "
        "window - 1 past the window (138 instead of 127): the cache's `[-window + 1:]` slice is decided on the "
        "sample's length",
        upstream="transformers==5.24.0 cache_utils.py DynamicSlidingWindowLayer.update "
        "(`full_key_states[:, :, -self.sliding_window + 1 :, :]`); torch 2.13 slice normalisation and "
        "check_contiguous_sizes_strides guard on the sample",
        # OpenVINO is not affected: its conversion keeps the slice's negative start, which its Slice clamps at
        # run time (the examples match eager there without the rule).
        backends=("dynamo", "onnx", "executorch"),
        scan=(
            ScanCause(
                "sliding-window-slice",
                "window-slice",
                "update",
                "a cache layer keeps `full[:, :, -window + 1:]`: the sign of the start is decided on the sample",
            ),
        ),
        models=("gpt_oss", "mistral", "gemma2", "cohere2", "olmo3"),
        examples=(
            Match(
                lambda: _mistral(5),
                "window 8, exported from 5 tokens, then 13 tokens with a left-padded row of 11 (fully masked rows)",
                atol=1e-5,
                other_inputs=lambda: _inputs(13, batch=3, padded=True),
                needs=_NEEDS,
            ),
            Match(
                lambda: _mistral(5, padded=True),
                "a left-padded sample of 5 tokens, then exactly the window (8) and batch 3",
                atol=1e-5,
                other_inputs=lambda: _inputs(_WINDOW, batch=3),
                needs=_NEEDS,
            ),
            NoMatch(_static_mistral, "Mistral exported static", reason="a static length: the original's slice"),
        ),
    ),
    target=_TARGET,
    replacement=update,
    applies=_uses_sliding_cache,
)
