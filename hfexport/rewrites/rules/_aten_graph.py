"""Reading calls of a captured ATen graph: SDPA's arguments, sizes, full slices (ExecuTorch and OpenVINO rules)."""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

SDPA = torch.ops.aten.scaled_dot_product_attention.default
# Positional order of the ATen schema's arguments; `scale` and `enable_gqa` are keyword-only.
_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
_DEFAULTS: dict[str, Any] = {
    "attn_mask": None,
    "dropout_p": 0.0,
    "is_causal": False,
    "scale": None,
    "enable_gqa": False,
}


def sdpa_argument(node: fx.Node, name: str) -> Any:
    """The value of SDPA argument `name` in `node`, given by position or keyword, else its default."""
    if name in node.kwargs:
        return node.kwargs[name]
    index = _NAMES.index(name) if name in _NAMES else len(node.args)
    return node.args[index] if index < len(node.args) else _DEFAULTS[name]


def same_size(a: Any, b: Any) -> bool:
    """Whether two sizes are equal: ints, or SymInts of one shape env (one symbol per axis, so `==` decides)."""
    try:
        return bool(a == b)
    except Exception:  # a comparison the shape env cannot decide is not the same size
        return False


_END = 2**63 - 1  # the `end` of a full slice (`x[:, :]`) in a captured graph


def is_full_slice(node: object) -> bool:
    """Whether `node` is `aten.slice` keeping its whole axis (`x[:, :]`: start 0 or None, no end, step 1)."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target is not torch.ops.aten.slice.Tensor:
        return False
    start = node.args[2] if len(node.args) > 2 else None
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    return start in (0, None) and end in (_END, None) and step == 1
