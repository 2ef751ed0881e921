"""Static caches: a sliding-window layer as a plain static layer of the whole cache length.

transformers' `StaticCache` gives each sliding-window layer a `StaticSlidingWindowLayer` of
`min(window, max_cache_len)` slots, a ring buffer driven by a Python int (`cumulative_length_int`): `update`
picks "write at the counter", "roll by one" or "concatenate and keep the last window" with `if`s on it, and
`get_mask_sizes` sizes and offsets the sliding mask with it. A decode graph is traced at one value of that int,
so the branch and the mask sizes of the sample's step are baked in: one graph cannot serve the steps before and
past the window, and the int is no graph input (a cache pytree constant, another pytree at every step).

The replacement builds the cache as transformers does, then puts a `StaticLayer` of the whole `max_cache_len` in
place of each `StaticSlidingWindowLayer` (still marked `is_sliding`, so the masks are built as before). The
layer keeps every token at its own slot, written at the tensor counter `cumulative_length` (a graph input), and
the window is the sliding mask's alone: transformers' sliding mask function (`kv_idx > q_idx - window`, with
offset 0 over the slots) masks exactly the keys the ring buffer would have dropped, so attention sees the same
keys. Costs `max_cache_len - window` more slots per sliding layer. Matched by structure: any layer built as
exactly `StaticSlidingWindowLayer` (gemma2/3, cohere2, mistral, gpt-oss, exaone4...); subclasses that mix in other
state (`LinearAttentionAndStaticSlidingWindowAttentionLayer`) and `chunked_attention` layers are left as they
are.
"""

from __future__ import annotations

from typing import Any

import torch

from hfexport.rewrites.example_models import sliding_mistral
from hfexport.rewrites.examples import Built, Match, NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, ModuleFunctionPatch
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.patch._sliding_window import PrefixThenStep, static_example

_TARGET = "transformers.cache_utils.StaticCache.__init__"


def init(original: Any, cache: Any, *args: Any, **kwargs: Any) -> Any:
    from transformers.cache_utils import StaticLayer, StaticSlidingWindowLayer

    config = kwargs.get("config", args[0] if args else None)
    max_cache_len = kwargs.get("max_cache_len", args[1] if len(args) > 1 else None)
    if not isinstance(max_cache_len, int) or not _sliding_types(config):
        return NOT_APPLICABLE
    original(cache, *args, **kwargs)
    for i, layer in enumerate(cache.layers):
        if type(layer) is StaticSlidingWindowLayer:
            full = StaticLayer(max_cache_len=max_cache_len)
            full.is_sliding = True  # the masks of this layer stay the sliding ones (`Cache.is_sliding`)
            cache.layers[i] = full
    return None


def _sliding_types(config: Any) -> bool:
    """Whether the static cache transformers builds for `config` has a `StaticSlidingWindowLayer`."""
    from transformers import cache_utils

    try:
        layer_types, _ = cache_utils.get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    except (AttributeError, TypeError, ValueError):
        return False
    ring = cache_utils.StaticSlidingWindowLayer
    return any(cache_utils.STATIC_LAYER_TYPE_MAPPING.get(t) is ring for t in layer_types)


def _static_sliding(model: torch.nn.Module) -> bool:
    return _sliding_types(getattr(model, "config", None))


_WINDOW, _SLOTS = 6, 24


class _StaticPrefixThenStep(PrefixThenStep):
    """A causal LM that builds a static cache of `_SLOTS` slots, runs a prefix into it, then a step of new tokens,
    as generate does with `cache_implementation="static"`. Outputs: the step's logits."""

    def new_cache(self) -> Any:
        from transformers import StaticCache

        return StaticCache(config=self.config, max_cache_len=_SLOTS)

    def outputs(self, out: Any, cache: Any) -> torch.Tensor:
        return out.logits


def _inputs(prefix: int, step: int, padding: int = 2) -> dict[str, Any]:
    ids = torch.randint(3, 64, (2, prefix + step), generator=torch.Generator().manual_seed(prefix * 100 + step))
    mask = torch.ones_like(ids)
    mask[1, :padding] = 0  # a left-padded row
    parts = {
        "prefix_ids": ids[:, :prefix],
        "input_ids": ids[:, prefix:],
        "prefix_mask": mask[:, :prefix],
        "step_mask": mask[:, prefix:],
    }
    return {name: value.contiguous() for name, value in parts.items()}  # ExecuTorch takes contiguous inputs


def _before_the_window(attention: str = "sdpa") -> Built:
    return _StaticPrefixThenStep(sliding_mistral(_WINDOW, attention)).eval(), _inputs(3, 2)


static_sliding_window_full_length = ModuleFunctionPatch(
    RuleMeta(
        id="patch/static-sliding-window-full-length",
        why="generation with a static cache on gemma2/cohere2/gemma3_text/mistral: the decode graph was traced at "
        "one value of `StaticSlidingWindowLayer.cumulative_length_int`, a Python int that picks the ring buffer's "
        "branch (write, roll, or concatenate) and the sliding mask's size and offset, and is no graph input (a "
        "pytree constant): cohere2 and gemma3_text (window 16, cache 64) took a 16-slot sliding mask and the "
        "sample's branch at every step",
        upstream="transformers==5.24.0 cache_utils.py StaticSlidingWindowLayer.update/get_mask_sizes "
        "(`is_full = self.cumulative_length_int >= self.max_cache_len`); StaticCache.__init__ maps "
        "'sliding_attention' to it",
        models=("gemma2", "gemma3_text", "cohere2", "mistral", "gpt_oss", "exaone4"),
        examples=(
            Match(
                lambda: _before_the_window(),
                f"mistral, window {_WINDOW}, a {_SLOTS}-slot static cache: exported from a 3-token prefix and 2 "
                "tokens (before the window), then a 9-token left-padded prefix (past it) and 2 tokens",
                atol=1e-5,
                other_inputs=lambda: _inputs(9, 2),
                needs=("aten/sdpa-fully-masked-rows", "openvino/sdpa-fully-masked-rows"),
            ),
            Match(
                lambda: _before_the_window("eager"),
                "the same with eager attention (an additive float mask), then a 12-token prefix and 3 tokens",
                atol=1e-5,
                other_inputs=lambda: _inputs(12, 3),
            ),
            NoMatch(static_example, "Mistral with a dynamic cache", reason="no StaticCache is built"),
        ),
    ),
    target=_TARGET,
    replacement=init,
    applies=_static_sliding,
    records=True,
)
