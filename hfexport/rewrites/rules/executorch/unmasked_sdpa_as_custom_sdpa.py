"""Unmasked self-attention: ExecuTorch's fused `llama::custom_sdpa` instead of SDPA's math decomposition.

`to_edge` decomposes `scaled_dot_product_attention` into `bmm -> softmax -> bmm`, and the memory plan holds the
`batch x heads x tokens x tokens` score tensors at the axes' caps. YOLOS (tiny corpus config: patch 4 on 512 x 864
images, 27 748 tokens) plans 148 GB that way at batch 8, and even its sweep shape (batch 3, 512 x 512) needs
about 20 GB of score buffers. ExecuTorch's own CPU kernel `llama::custom_sdpa` (a tiled flash attention,
`extension/llm/custom_ops/op_sdpa.cpp`) keeps no score tensor in the plan: the program plans its inputs and
output only. With `start_pos = 0` and no mask it attends over the first `tokens` keys, all of them when query
and keys have the same length, which is why the rule takes self-attention only.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx

from hfexport.rewrites.examples import Built, Match, NoMatch
from hfexport.rewrites.kinds.fx import NodeRule, fill_missing_values
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules._aten_graph import SDPA, same_size, sdpa_argument

_TRANSPOSE = torch.ops.aten.transpose.int
# The dtypes custom_sdpa takes (executorch extension/llm/custom_ops/custom_ops.py `_validate_params`).
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _unmasked_self_attention(node: fx.Node) -> bool:
    """SDPA without mask, dropout, causality or grouped heads, over 4-D query, key and value of one dtype with
    the same heads, tokens and head size (self-attention: query length == key length)."""
    if node.op != "call_function" or node.target is not SDPA:
        return False
    if sdpa_argument(node, "attn_mask") is not None:
        return False
    if sdpa_argument(node, "is_causal") or sdpa_argument(node, "enable_gqa"):
        return False
    if sdpa_argument(node, "dropout_p") not in (0, 0.0):
        return False
    values = [getattr(n, "meta", {}).get("val") for n in node.args[:3]]
    if len(values) != 3 or not all(isinstance(v, torch.Tensor) and v.dim() == 4 for v in values):
        return False
    query, key, value = values
    if query.dtype not in _DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        return False
    return all(same_size(query.shape[axis], t.shape[axis]) for t in (key, value) for axis in (0, 1, 2, 3))


def _custom_sdpa(gm: fx.GraphModule, node: fx.Node) -> None:
    """`sdpa(q, k, v, scale=s)` on (batch, heads, tokens, dim) -> custom_sdpa on (batch, tokens, heads, dim)."""
    import executorch.extension.llm.custom_ops.custom_ops  # noqa: F401 - registers llama::custom_sdpa

    query, key, value = node.args[:3]
    scale = sdpa_argument(node, "scale")
    with gm.graph.inserting_before(node):
        q, k, v = (gm.graph.call_function(_TRANSPOSE, (x, 1, 2)) for x in (query, key, value))
        fused = gm.graph.call_function(torch.ops.llama.custom_sdpa.default, (q, k, v, 0, None, 0.0, False, scale))
        out = gm.graph.call_function(_TRANSPOSE, (fused, 1, 2))
    for new in (q, k, v, fused, out):
        new.meta["stack_trace"] = node.meta.get("stack_trace")
        new.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
    node.replace_all_uses_with(out)
    gm.graph.erase_node(node)
    fill_missing_values(gm)


class _PatchAttention(torch.nn.Module):
    """A ViT/YOLOS encoder attention: heads split off projections, SDPA over all tokens, heads merged back."""

    def __init__(self, masked: bool = False, scale: float | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.qkv = torch.nn.Linear(16, 48)
        self.out = torch.nn.Linear(16, 16)
        self.masked = masked
        self.scale = scale

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        batch, tokens, hidden = x.shape
        q, k, v = self.qkv(x).view(batch, tokens, 3, 2, hidden // 2).permute(2, 0, 3, 1, 4).unbind(0)
        bias = None
        if self.masked:
            bias = torch.zeros(batch, 1, 1, tokens).masked_fill(mask[:, None, None, :] == 0, float("-inf"))
        mixed = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=self.scale)
        return self.out(mixed.transpose(1, 2).reshape(batch, tokens, hidden))


def _tokens(batch: int, tokens: int, seed: int = 0, masked: bool = False) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    feed: dict[str, Any] = {"x": torch.randn(batch, tokens, 16, generator=generator)}
    if masked:
        mask = torch.ones(batch, tokens, dtype=torch.long)
        mask[0, :2] = 0  # padding
        feed["mask"] = mask
    return feed


def _built(masked: bool = False, scale: float | None = None) -> Built:
    return _PatchAttention(masked, scale), _tokens(2, 7, masked=masked)


unmasked_sdpa_as_custom_sdpa = NodeRule(
    RuleMeta(
        id="executorch/unmasked-sdpa-as-custom-sdpa",
        why="to_edge decomposes SDPA into bmm -> softmax -> bmm, so memory planning keeps batch x heads x tokens "
        "x tokens score tensors at the axes' caps: YOLOS (corpus config: patch 4 on a 512 x 864 image_size, "
        "27 748 tokens) planned 147 926 594 848 bytes at batch 8 and the load refused it; even its batch+1 "
        "sample (3 x 512 x 512) needs about 20 GB of scores. ExecuTorch's fused CPU kernel llama::custom_sdpa "
        "(tiled flash attention) plans no score tensor; it takes (batch, tokens, heads, dim) and, with "
        "start_pos 0 and no mask, attends over as many keys as queries, so only unmasked, non-causal "
        "self-attention with equal heads is rewritten",
        upstream="executorch==1.4.1 exir memory planning of the SDPA decomposition; "
        "executorch extension/llm/custom_ops (custom_sdpa, op_sdpa.cpp cpu_flash_attention)",
        backends=("executorch",),
        needed="the need is memory, not numbers: tests/rewrites/test_executorch_unmasked_sdpa_as_custom_sdpa.py "
        "plans the example attention with and without the rule (YOLOS: 148 GB of score buffers without it, refused "
        "at load)",
        models=("yolos",),
        examples=(
            Match(
                lambda: _built(),
                "unmasked self-attention over dynamic batch and tokens, then another batch and length",
                other_inputs=lambda: _tokens(3, 19, seed=1),
            ),
            Match(
                lambda: _built(scale=0.3),
                "an explicit scale, then another batch and length",
                other_inputs=lambda: _tokens(1, 12, seed=2),
            ),
            NoMatch(
                lambda: _built(masked=True),
                "the same attention with a padding mask",
                reason="attn_mask is set: custom_sdpa with a mask is not the same contract, SDPA stays",
            ),
        ),
    ),
    predicate=_unmasked_self_attention,
    rewrite=_custom_sdpa,
)
