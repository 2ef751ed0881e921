"""`aten.cat` forms that the OpenVINO PyTorch frontend does not translate."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from hfexport.rewrites.example_models import dense_decoder
from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.fx import NodeRule
from hfexport.rewrites.rule import RuleMeta


def _static_shape(node: Any) -> tuple[int, ...] | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(value, torch.Tensor):
        return None
    shape = tuple(value.shape)
    return shape if all(isinstance(d, int) for d in shape) else None


def _is_legacy_empty(node: Any) -> bool:
    # torch.cat skips 1-D tensors of shape (0,) whatever the other inputs' rank (legacy behaviour kept by
    # torch for `torch.tensor([])` placeholders such as transformers' lazily initialised cache layers).
    return _static_shape(node) == (0,)


def _kept_inputs(node: fx.Node) -> list[Any] | None:
    """The inputs of a `cat` with its legacy-empty ones dropped, or None when there is nothing to drop safely."""
    if node.op != "call_function" or node.target is not torch.ops.aten.cat.default:
        return None
    out = node.meta.get("val")
    if not isinstance(out, torch.Tensor) or out.ndim == 1:
        # A 1-D concat of empty vectors is an ordinary concat that OpenVINO converts.
        return None
    tensors = node.args[0]
    kept = [t for t in tensors if not _is_legacy_empty(t)]
    if len(kept) == len(tensors) or not kept:
        return None
    # The empty inputs take part in type promotion: drop them only when the others alone give the same dtype.
    dtypes = [t.meta["val"].dtype for t in kept if isinstance(t, fx.Node) and "val" in t.meta]
    if len(dtypes) != len(kept):
        return None
    promoted = dtypes[0]
    for dtype in dtypes[1:]:
        promoted = torch.promote_types(promoted, dtype)
    return kept if promoted == out.dtype else None


def _drop_empty_inputs(gm: fx.GraphModule, node: fx.Node) -> None:
    kept = _kept_inputs(node)
    assert kept is not None
    node.args = (kept, *node.args[1:])


class _CatOntoEmpty(torch.nn.Module):
    """A cache-like buffer that starts as `torch.tensor([])` and grows by concatenation on the length axis."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        empty = torch.tensor([], dtype=x.dtype)
        return torch.cat([empty, x * 2, empty, x], dim=-2)


class _CatPromotes(torch.nn.Module):
    """The empty input is float64: it decides the result dtype, so it must stay."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.tensor([], dtype=torch.float64), x], dim=0)


class _CatVectors(torch.nn.Module):
    """An ordinary 1-D concat with an empty vector."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([torch.zeros(0), x.flatten()], dim=0)


def _cat_onto_empty() -> tuple[torch.nn.Module, dict[str, Any]]:
    return _CatOntoEmpty(), {"x": torch.randn(2, 3, 5, 4)}


def _llama_with_cache() -> tuple[torch.nn.Module, dict[str, Any]]:
    model, inputs = dense_decoder()
    # No use_cache kwarg: the config's default (True) makes the forward build and fill a DynamicCache.
    return model, {"input_ids": inputs["input_ids"]}


cat_drop_legacy_empty = NodeRule(
    RuleMeta(
        id="openvino/cat-drop-legacy-empty",
        why="openvino.convert_model fails with 'Axis -2 out of the tensor rank range' on aten.cat of a 1-D "
        "empty tensor with N-D tensors, which torch skips; every transformers DynamicCache layer starts as "
        "torch.tensor([]) and concatenates its first keys/values onto it",
        upstream="openvino==2026.4.1 src/frontends/pytorch/src/op/cat.cpp (translate_cat has no legacy empty-input "
        "skip; cf. pytorch/pytorch#5889 for the torch behaviour)",
        backends=("openvino",),
        models=("llama", "gpt2", "qwen3", "mistral"),
        examples=(
            Match(
                _cat_onto_empty,
                "two empty placeholders among rank-4 inputs, concat on a dynamic length axis",
                other_inputs=lambda: {"x": torch.randn(3, 3, 7, 4)},
            ),
            Match(
                _llama_with_cache,
                "a Llama forward that fills a fresh DynamicCache",
                other_inputs=lambda: {"input_ids": torch.randint(0, 64, (3, 9))},
            ),
            NoMatch(lambda: (_CatPromotes(), {"x": torch.randn(2, 3)}), "the empty input decides the dtype"),
            NoMatch(lambda: (_CatVectors(), {"x": torch.randn(2, 3)}), "a 1-D concat"),
            NoMatch(dense_decoder, "a Llama forward without a cache"),
        ),
    ),
    predicate=lambda node: _kept_inputs(node) is not None,
    rewrite=_drop_empty_inputs,
)
