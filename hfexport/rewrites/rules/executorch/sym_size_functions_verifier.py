"""Symbolic-size functions (`torch.sym_min`, `torch.sym_max`, ...) through the edge-dialect verifier."""

from __future__ import annotations

from typing import Any

import torch

from hfexport.rewrites.examples import Built, Match, NoMatch
from hfexport.rewrites.kinds.executorch import ExecutorchVerifierExceptionRule
from hfexport.rewrites.rule import RuleMeta

# The Python functions of symbolic sizes that ExecuTorch maps to its own prim ops (executorch_prim::sym_min.Scalar,
# ...) in to_executorch (ReplaceEdgeWithBackendPass) and evaluates at run time.
_SYM_FUNCTIONS = (torch.sym_min, torch.sym_max, torch.sym_float, torch.sym_int, torch.sym_not, torch.sym_ite)


class _TopkOfShorter(torch.nn.Module):
    """axk2's indexer: the top `min(k, length)` scores per row (a top-k never longer than the sequence)."""

    def __init__(self, k: int = 4, largest: bool = False) -> None:
        super().__init__()
        self.k = k
        self.largest = largest

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        length = scores.shape[-1]
        k = max(length - self.k, 1) if self.largest else min(self.k, length)
        return torch.topk(scores, k, dim=-1).values * 2.0


def _scores(batch: int, length: int, seed: int = 0) -> dict[str, Any]:
    return {"scores": torch.randn(batch, length, generator=torch.Generator().manual_seed(seed))}


def _built(length: int, largest: bool = False) -> Built:
    return _TopkOfShorter(largest=largest), _scores(2, length)


sym_size_functions_verifier = ExecutorchVerifierExceptionRule(
    RuleMeta(
        id="executorch/sym-size-functions-verifier",
        why="to_edge fails with a bare AssertionError in the edge-dialect verifier (it accepts no Python "
        "function but `alloc`) on `torch.sym_min` / `torch.sym_max` of sizes, such as axk2's and "
        "deepseek_v4's indexer `topk(k=min(top_k, length))`, although ExecuTorch maps them to its own prim "
        "ops later (to_executorch) and runs them; they go into EdgeCompileConfig's verifier exception list. "
        "(Rewriting min as integer arithmetic instead loses the `Min` that proves `k <= length` to the "
        "re-trace, which then guards the sequence axis to the sample)",
        upstream="https://github.com/pytorch/executorch/issues/11988 (sym_max support; PR #12037 added the prim ops, "
        "tested only with _check_ir_validity=False); executorch 1.4.1 exir/verification/verifier.py "
        "check_valid_edge_op asserts on every FunctionType but alloc",
        backends=("executorch",),
        # A dynamic export's size arithmetic calls torch.sym_min / sym_float / sym_ite... (a conv's output length,
        # a capacity, a block count), which to_edge's verifier refuses although ExecuTorch runs them; the rule only
        # lets them through (the graph is unchanged), so every example export keeps it.
        baseline=True,
        models=("axk2", "deepseek_v4"),
        examples=(
            Match(
                lambda: _built(6),
                "topk(k=min(4, length)) at length 6 (k = 4), then length 3 (k = 3)",
                other_inputs=lambda: _scores(3, 3, seed=1),
            ),
            Match(
                lambda: _built(4),
                "the sample at the boundary (length 4 = k), then length 9: the axis stays dynamic",
                other_inputs=lambda: _scores(2, 9, seed=3),
            ),
            Match(
                lambda: _built(3, largest=True),
                "topk(k=max(length - 4, 1)) at length 3 (k = 1), then length 9 (k = 5)",
                other_inputs=lambda: _scores(2, 9, seed=2),
            ),
            NoMatch(lambda: _built(6), "the same indexer exported static: min(4, 6) is folded to 4"),
        ),
    ),
    targets=_SYM_FUNCTIONS,
)
