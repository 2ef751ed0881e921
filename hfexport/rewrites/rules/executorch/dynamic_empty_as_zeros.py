"""`empty` with symbolic sizes: keep the sizes symbolic through to_edge's dim-order pass."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.fx.experimental.symbolic_shapes import free_symbols

from hfexport.rewrites.examples import Built, Match, NoMatch
from hfexport.rewrites.kinds.fx import NodeRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.executorch._view_sizes import view_sizes

_EMPTY = torch.ops.aten.empty.memory_format
_NEW_EMPTY = torch.ops.aten.new_empty.default
_EMPTY_LIKE = torch.ops.aten.empty_like.default
_FULL = torch.ops.aten.full.default


def _symbolic_empty(node: fx.Node) -> bool:
    """An uninitialised allocation (`empty`, `new_empty`, `empty_like`) with a symbolic size."""
    if node.op != "call_function" or node.target not in (_EMPTY, _NEW_EMPTY, _EMPTY_LIKE):
        return False
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and any(free_symbols(size) for size in value.shape)


def _zeros_instead(gm: fx.GraphModule, node: fx.Node) -> None:
    """`empty(sizes)` -> `full(sizes, 0)`: an uninitialised tensor may hold any value, so zeros are one of
    the values it may have; every element a correct program reads was written first."""
    value = node.meta["val"]
    with gm.graph.inserting_before(node):
        if node.target is _EMPTY:
            sizes = node.args[0]
        elif node.target is _NEW_EMPTY:
            sizes = node.args[1]
        else:
            sizes = view_sizes(gm, node.args[0])
        full = gm.graph.call_function(
            _FULL,
            (list(sizes), 0),
            {"dtype": value.dtype, "layout": torch.strided, "device": value.device, "pin_memory": False},
        )
    full.meta = dict(node.meta)
    node.replace_all_uses_with(full)
    gm.graph.erase_node(node)


class _SplitKeys(torch.nn.Module):
    """DeepSeek's MLA keys: `new_empty(...)`, then the no-position and rotary parts written into its halves."""

    def __init__(self, like: bool = False) -> None:
        super().__init__()
        self.like = like

    def forward(self, nope: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
        if self.like:
            keys = torch.empty_like(torch.cat([nope, rot], dim=-1))
        else:
            keys = nope.new_empty(*nope.shape[:-1], nope.shape[-1] + rot.shape[-1])
        keys[..., : nope.shape[-1]] = nope
        keys[..., nope.shape[-1] :] = rot
        return keys * 2.0


def _parts(batch: int, length: int, seed: int = 0) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "nope": torch.randn(batch, 2, length, 4, generator=generator),
        "rot": torch.randn(batch, 2, length, 3, generator=generator),
    }


def _built(like: bool = False) -> Built:
    return _SplitKeys(like), _parts(2, 5)


dynamic_empty_as_zeros = NodeRule(
    RuleMeta(
        id="executorch/dynamic-empty-as-zeros",
        why="to_edge's dim-order pass turns `empty` into executorch's `_empty_dim_order`, whose schema takes "
        "`int[] size` (not SymInt[]): re-running it converts each symbolic size to an int, which guards batch "
        "and sequence to the sample's, and the program is planned for the sample shape only (deepseek_v2, "
        "deepseek_v3, axk2: the grown input was refused). `full(sizes, 0)` keeps the sizes symbolic; zeros "
        "are a valid content of an uninitialised tensor",
        upstream="executorch==1.4.1 exir/passes/dim_order_ops_registry.py (`_empty_dim_order(int[] size, ...)`), "
        "applied by MemoryFormatOpsPass in to_edge; transformers deepseek_v3 `kv_nope.new_empty(...)`",
        backends=("executorch",),
        models=("deepseek_v2", "deepseek_v3", "axk2"),
        examples=(
            Match(
                lambda: _built(),
                "new_empty over dynamic batch and length, filled by slices, then a longer input",
                other_inputs=lambda: _parts(3, 11, seed=1),
            ),
            Match(
                lambda: _built(like=True),
                "empty_like over dynamic batch and length, then a longer input",
                other_inputs=lambda: _parts(1, 9, seed=2),
            ),
            NoMatch(lambda: _built(), "the same keys exported static: `empty` keeps its int sizes"),
        ),
    ),
    predicate=_symbolic_empty,
    rewrite=_zeros_instead,
)
