"""`patch/qsa-indexer-vectorized` against Qwen4-Exp's own QSA indexer, in eager: the same selection mask.

The original keeps each row's top blocks with `topk`, whose order among exactly equal scores (relu makes many
blocks score 0) is left to std::nth_element on CPU; the rule keeps the earlier block. The reference here is the
original forward with a top-k that breaks ties the same way (a stable descending sort), so every other
difference would show: left padding, rows with fewer visible keys than one block, more complete blocks than the
budget keeps, the sweep's lengths and another batch. A second test shows the tie is the only difference: without
ties at the cut, the unmodified original gives the same mask.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from hfexport.rewrites.rules.patch.qsa_indexer_vectorized import _qwen4, is_qsa_indexer, qsa_indexer_forward


def _stable_topk(self: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> Any:
    values, indices = torch.sort(self, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


def _masks(tokens: int, left_pad: int, budget: int, batch: int, stable: bool) -> tuple[torch.Tensor, torch.Tensor]:
    model, inputs = _qwen4(tokens, left_pad=left_pad, budget=budget, batch=batch)
    (indexer,) = [m for m in model.modules() if is_qsa_indexer(m)]
    seen: dict[str, Any] = {}
    handle = indexer.register_forward_hook(lambda m, a, k, o: seen.update(args=a, kwargs=k), with_kwargs=True)
    with torch.no_grad():
        model(**inputs)
        handle.remove()
        original = type(indexer).forward
        if stable:
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(torch.Tensor, "topk", _stable_topk)
                expected = original(indexer, *seen["args"], **seen["kwargs"])
        else:
            expected = original(indexer, *seen["args"], **seen["kwargs"])
        actual = qsa_indexer_forward(None, indexer, *seen["args"], **seen["kwargs"])
    return expected, actual


@pytest.mark.parametrize(
    ("tokens", "left_pad", "budget", "batch"),
    [(8, 3, 8, 2), (13, 5, 8, 3), (5, 4, 8, 2), (3, 0, 8, 2), (23, 2, 8, 2), (73, 7, 16, 2), (138, 3, 16, 2)],
)
def test_same_mask_as_the_original_with_earlier_block_ties(tokens: int, left_pad: int, budget: int, batch: int) -> None:
    expected, actual = _masks(tokens, left_pad, budget, batch, stable=True)
    assert actual.dtype == torch.bool and actual.shape == expected.shape == (batch, 1, tokens, tokens)
    assert torch.equal(actual, expected)


def test_same_mask_as_the_unmodified_original_without_ties() -> None:
    # 23 tokens, budget 8: rows keep 2 of up to 5 blocks; these rows have no tie at the cut (checked by equality).
    expected, actual = _masks(23, 2, 8, 2, stable=False)
    assert torch.equal(actual, expected)


def test_predicate() -> None:
    model, _ = _qwen4(4)
    assert sum(is_qsa_indexer(m) for m in model.modules()) == 1
    model, _ = _qwen4(4, layer="linear_attention")
    assert not any(is_qsa_indexer(m) for m in model.modules())
