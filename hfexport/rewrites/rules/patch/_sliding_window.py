"""What the sliding-window cache patches share: which models run a given `DynamicSlidingWindowLayer` method."""

from __future__ import annotations

from typing import Any

import torch

from hfexport.rewrites.example_models import sliding_mistral
from hfexport.rewrites.examples import Built, Match


def inherits(cls: Any, method: str) -> bool:
    """Whether `cls` is a DynamicSlidingWindowLayer that runs its `method` (not an override of it)."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    for klass in getattr(cls, "__mro__", ()):
        if klass is DynamicSlidingWindowLayer:
            return True
        if method in klass.__dict__:
            return False
    return False


def uses_sliding_layer_method(model: torch.nn.Module, method: str) -> bool:
    """Whether the dynamic cache transformers builds for this model's config has a layer running `method` of
    DynamicSlidingWindowLayer: the layer types of the config (`layer_types`, or a `sliding_window` per layer)
    mapped to their classes."""
    from transformers import cache_utils

    config = getattr(model, "config", None)
    try:
        layer_types, _ = cache_utils.get_layer_types_and_kwargs(config.get_text_config(decoder=True))
    except (AttributeError, TypeError, ValueError):
        return False
    return any(inherits(cache_utils.DYNAMIC_LAYER_TYPE_MAPPING.get(t), method) for t in layer_types)


# -- the examples of the rules that carry a sliding-window counter past the window -----------------------------

_WINDOW = 6


class PrefixThenStep(torch.nn.Module):
    """A causal LM that runs a prefix into a fresh cache, then a step of new tokens on that cache: the step's
    masks are sized by the token counter the prefix left (a symbolic one, since the prefix length is), as a
    generation decode step's are. Outputs: the step's logits and every cache layer's kept keys and values."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.config = model.config

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.config)

    def outputs(self, out: Any, cache: Any) -> tuple[torch.Tensor, ...]:
        return (out.logits, *(t for layer in cache.layers for t in (layer.keys, layer.values)))

    def forward(
        self, prefix_ids: torch.Tensor, input_ids: torch.Tensor, prefix_mask: torch.Tensor, step_mask: torch.Tensor
    ) -> Any:
        cache = self.new_cache()
        # The mask in two inputs: one of `prefix + step` tokens would be a derived dimension, whose guard function
        # torch.onnx's decomposition cannot run.
        attention_mask = torch.cat([prefix_mask, step_mask], dim=-1)
        prefix = prefix_ids.shape[1]
        # Positions count each row's real tokens (left padding), as generate's do.
        positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        self.model(
            input_ids=prefix_ids,
            attention_mask=prefix_mask,
            position_ids=positions[:, :prefix],
            past_key_values=cache,
            use_cache=True,
        )
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=positions[:, prefix:],
            past_key_values=cache,
            use_cache=True,
        )
        return self.outputs(out, cache)


def _mistral(attention: str = "sdpa") -> torch.nn.Module:
    return PrefixThenStep(sliding_mistral(_WINDOW, attention)).eval()


def _inputs(prefix: int, step: int, batch: int = 2, padding: int = 2) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(prefix * 100 + step)
    ids = torch.randint(3, 64, (batch, prefix + step), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, :padding] = 0  # a left-padded row
    return {
        "prefix_ids": ids[:, :prefix],
        "input_ids": ids[:, prefix:],
        "prefix_mask": mask[:, :prefix],
        "step_mask": mask[:, prefix:],
    }


def _before_window() -> Built:
    # The sample's counter (3) is below the window, as a generation sample's is; a 2-token step keeps the step
    # length dynamic.
    return _mistral(), _inputs(3, 2)


def static_example() -> Built:
    """Mistral (window 6) run on a 9-token prefix then one token, for an export with static shapes."""
    return _mistral(), _inputs(9, 1)


def eager_attention_example() -> Built:
    """The same model with eager attention: its mask is always built (no "skip the causal mask?" check)."""
    return _mistral("eager"), _inputs(3, 1)


def examples_past_the_window(needs: tuple[str, ...]) -> tuple[Match, ...]:
    """Exported before the window, then run at and past it (with a left-padded row, fully masked on ONNX)."""
    needs = (*needs, "aten/sdpa-fully-masked-rows")
    return (
        Match(
            _before_window,
            f"window {_WINDOW}: exported from a 3-token prefix, then a 16-token prefix and 2 new tokens (past it)",
            atol=1e-5,
            other_inputs=lambda: _inputs(16, 2),
            needs=needs,
        ),
        Match(
            _before_window,
            "exported before the window, then a 3-token step that reaches it (prefix 4, window 6, batch 3)",
            atol=1e-5,
            other_inputs=lambda: _inputs(4, 3, batch=3),
            needs=needs,
        ),
    )
