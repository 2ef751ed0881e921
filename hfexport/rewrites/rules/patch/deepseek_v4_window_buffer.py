"""DeepSeek-V4: the compressor cache's remainder buffer, empty at a sample that is a multiple of the window.

`DeepseekV4HCACache.store_compression_weights` (also the CSA cache's, which inherits it) returns the whole
windows `kv[:, :usable]` to compress and keeps the remainder `kv[:, usable:]` (`L % compress_rate` tokens) in
the cache for the next call. At the 8-token sample (CSA windows of 4) the remainder has no rows. make_fx
records every node's tensor metadata, whose contiguity test evaluates `numel() < 2` on the sample's sizes
(torch 2.13 `_prims_common.is_contiguous` via `shape_prop._extract_tensor_metadata`): for this tensor that
is a guard that the remainder is empty, and the Dynamo program refused 13 tokens ("Guard failed: 64 *
input_ids.size()[0] * (input_ids.size()[1] + -4 * (input_ids.size()[1] // 4)) < 2", kv being 2 x 32 wide).
Any tensor of L % 4 rows guards the same (an `arange(usable, L)` too), whichever way it is cut.

The replacement reads the remainder's row count back as a data-dependent size (`.item()` of `L - usable`,
checked to lie in [0, compress_rate)), for which torch decides nothing on the sample, and selects the same
rows with `index_select` over `usable + arange(count)`; the whole windows are selected over `arange(usable)`.
Same rows, same values (bit for bit); buffered rows of an earlier call are concatenated first and the window
position is the original's. Dynamo only: ONNX programs keep no guards (the model already matched there).

Generation does not need it on ONNX either: with the rule on ONNX too, only the prefill's output
buffer axis changes (an unbacked size instead of `L - 4 * (L // 4)`), and the ONNX decode program fails as before.
That failure is in the decode program, which is traced from generate's first decode step after the 8-token
sample: there the CSA buffers have 0 rows (an input axis torch.export specialises to 0), `entry_count` is a
constant of the cache context (2), and the step closes no window, so the traced graph never compresses (cause
`deepseek-v4-decode-window-state`, docs/coverage.md).
"""

from __future__ import annotations

from typing import Any

import torch

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.patch import ModuleFunctionPatch
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.patch._deepseek_v4 import EXAMPLE_NEEDS, deepseek_v4_example, longer_inputs

_MODULE = "transformers.models.deepseek_v4.modeling_deepseek_v4"


def store_compression_weights(
    original: Any, layer: Any, name: str, kv: torch.Tensor, gate: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    first_window_position = layer.entry_count[name] * layer.compress_rate
    buffered_kv, buffered_gate = layer.buffer_kv[name], layer.buffer_gate[name]
    if buffered_kv is not None and buffered_kv.shape[1]:
        kv = torch.cat([buffered_kv, kv], dim=1)
        gate = torch.cat([buffered_gate, gate], dim=1)
    length = kv.shape[1]
    usable = (length // layer.compress_rate) * layer.compress_rate
    whole = torch.arange(usable, device=kv.device)
    # Changed: the remainder's row count as a size the trace does not know (see the module docstring).
    left = torch.scalar_tensor(length - usable, dtype=torch.long).item()
    torch._check(left >= 0)
    torch._check(left < layer.compress_rate)
    rest = torch.arange(left, device=kv.device) + usable
    layer.buffer_kv[name], layer.buffer_gate[name] = kv.index_select(1, rest), gate.index_select(1, rest)
    return kv.index_select(1, whole), gate.index_select(1, whole), first_window_position


class _WithBuffers(torch.nn.Module):
    """DeepSeek-V4 with a cache, whose outputs are the hidden states and each compressor's buffered remainder
    and compressed entries (a cache object's tensors are not leaves of an eager output tree)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.config = model.config

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self.model(input_ids=input_ids, use_cache=True)
        cache = getattr(out, "cache", None) or out.past_key_values
        kept = []
        for layer in cache.layers:
            for state in ("buffer_kv", "buffer_gate", "compressed_kv"):
                kept.extend(t for t in getattr(layer, state, {}).values() if t is not None)
        return (out.last_hidden_state, *kept)


def _cached(tokens: int) -> tuple[Any, dict[str, Any]]:
    model, inputs = deepseek_v4_example(tokens)
    return _WithBuffers(model).eval(), {"input_ids": inputs["input_ids"]}


def _longer_cached(tokens: int, batch: int = 2) -> dict[str, Any]:
    return {"input_ids": longer_inputs(tokens, batch)["input_ids"]}


deepseek_v4_window_buffer = ModuleFunctionPatch(
    RuleMeta(
        id="patch/deepseek-v4-window-buffer",
        why="DeepSeek-V4 exported with a cache from 8 tokens refused 13 on Dynamo ('Guard failed: 64 * "
        "input_ids.size()[0] * (input_ids.size()[1] + -4 * (input_ids.size()[1] // 4)) < 2'): the compressor "
        "cache keeps the L % 4 remainder rows, none at the sample, and the trace's contiguity metadata guards "
        "`numel() < 2` on any tensor of that size; with the row count read back as a data-dependent size and "
        "the rows index-selected, nothing is decided on the sample",
        backends=("dynamo",),
        upstream="transformers==5.24.0 models/deepseek_v4/modeling_deepseek_v4.py "
        "DeepseekV4HCACache.store_compression_weights; torch 2.13 fx/passes/shape_prop.py _extract_tensor_metadata "
        "-> _prims_common.is_contiguous (`numel() < 2`)",
        models=("deepseek_v4",),
        examples=(
            Match(
                lambda: _cached(8),
                "with a cache: two whole windows at the sample (empty remainder), then 13 tokens and batch 3",
                atol=1e-5,
                other_inputs=lambda: _longer_cached(13, batch=3),
                needs=(*EXAMPLE_NEEDS, "patch/deepseek-v4-overlap-windows"),
            ),
            NoMatch(
                lambda: deepseek_v4_example(8),
                "without a cache",
                reason="the gate is installed (a DeepSeek-V4 model), but without a cache nothing stores windows",
            ),
        ),
    ),
    target=f"{_MODULE}.DeepseekV4HCACache.store_compression_weights",
    replacement=store_compression_weights,
)
