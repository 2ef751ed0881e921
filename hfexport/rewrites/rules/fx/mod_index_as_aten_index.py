"""A vmapped mask function's tensor indexing (`flat_apply` of torch's ModIndex) becomes `aten.index.Tensor`.

transformers' masking_utils builds a mask with `torch.vmap` over (batch, head, q, kv) indices when a model passes
an `and_mask_function` / `or_mask_function` (`use_vmap=True` in create_causal_mask / create_bidirectional_mask
/ create_sliding_window_causal_mask). Under `TransformGetItemToIndex` the padding mask function's
`padding_mask[batch_idx, kv_idx]` (and any other mask function that indexes a tensor: packed sequences, block
overlays, chunk offsets) runs torch._dynamo's `ModIndex` autograd.Function; non-strict torch.export records it
as `flat_apply(_ConstantFunction(_call_custom_autograd_function_in_pre_dispatch), spec, 'torch._dynamo.
_trace_wrapped_higher_order_op.ModIndex', x, [i, j])`, a higher-order op torch.export's serializer cannot
write ("Failed serializing node flat_apply").

`ModIndex.forward(x, indices)` is `torch.ops.aten.index(x, indices)` and it has `generate_vmap_rule = True`:
under vmap it is that same `aten.index` through its batching rule. The rule writes exactly that call in place
of the `flat_apply` node (inference only: the autograd.Function's backward is dropped). The vmap levels around
it (`_add_batch_dim` / `_remove_batch_dim`) stay as they are, and torch.export serializes them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import fx
from torch.utils import _pytree as pytree

from hfexport.rewrites.example_models import dense_decoder
from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.fx import NodeRule
from hfexport.rewrites.rule import RuleMeta

aten = torch.ops.aten


def _mod_index_name() -> str:
    from torch._dynamo._trace_wrapped_higher_order_op import ModIndex

    return f"{ModIndex.__module__}.{ModIndex.__qualname__}"


def _constant(node: Any) -> Any:
    """The value a `get_attr` node of the graph reads, or None."""
    if not isinstance(node, fx.Node) or node.op != "get_attr" or node.graph.owning_module is None:
        return None
    return getattr(node.graph.owning_module, node.target, None)


def _mod_index_operands(node: fx.Node) -> tuple[fx.Node, list[Any]] | None:
    """`(x, indices)` of a `flat_apply` that calls ModIndex through the pre-dispatch autograd.Function hook."""
    if node.op != "call_function" or node.target is not torch.ops.higher_order.flat_apply or node.kwargs:
        return None
    from torch._higher_order_ops.flat_apply import _ConstantFunction
    from torch.export.custom_ops import _call_custom_autograd_function_in_pre_dispatch

    if len(node.args) < 3:
        return None
    func_spec, in_spec = _constant(node.args[0]), _constant(node.args[1])
    if not (isinstance(func_spec, pytree.TreeSpec) and isinstance(in_spec, pytree.TreeSpec)):
        return None
    try:
        func = pytree._retrieve_constant(func_spec)
        args, kwargs = pytree.tree_unflatten(list(node.args[2:]), in_spec)
    except Exception:  # another spec shape: not this call
        return None
    if not isinstance(func, _ConstantFunction) or func.func is not _call_custom_autograd_function_in_pre_dispatch:
        return None
    if kwargs or len(args) != 3 or args[0] != _mod_index_name():
        return None
    x, indices = args[1], args[2]
    if not isinstance(x, fx.Node) or not isinstance(indices, (list, tuple)):
        return None
    if not all(i is None or isinstance(i, fx.Node) for i in indices):
        return None
    return x, list(indices)


def _is_mod_index(node: fx.Node) -> bool:
    return _mod_index_operands(node) is not None


def _as_aten_index(gm: fx.GraphModule, node: fx.Node) -> None:
    x, indices = _mod_index_operands(node)  # type: ignore[misc]
    specs = [a for a in node.args[:2] if isinstance(a, fx.Node)]
    with gm.graph.inserting_before(node):
        replacement = gm.graph.call_function(aten.index.Tensor, (x, indices))
    replacement.meta.update(node.meta)
    node.replace_all_uses_with(replacement)
    gm.graph.erase_node(node)
    # The two spec constants the flat_apply read are dead now (each flat_apply has its own).
    for spec in specs:
        if not spec.users:
            target = spec.target
            gm.graph.erase_node(spec)
            if not any(n.op == "get_attr" and n.target == target for n in gm.graph.nodes) and hasattr(gm, target):
                delattr(gm, target)


class _VmapMaskAttention(torch.nn.Module):
    """Attention scores masked with transformers' `sdpa_mask(use_vmap=True)`: a bidirectional sliding window
    (t5gemma2's encoder) and the padding mask, which indexes `attention_mask` inside the vmap."""

    def __init__(self, window: int = 3, blocks: bool = False, padding: bool = True) -> None:
        super().__init__()
        self.window, self.blocks, self.padding = window, blocks, padding

    def forward(self, scores: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        from transformers import masking_utils

        window = self.window

        def near(batch_idx: Any, head_idx: Any, q_idx: Any, kv_idx: Any) -> Any:
            dist = q_idx - kv_idx
            return (dist < window) & (-dist < window)

        mask_function = near
        if self.blocks:
            # Two blocks per row, split at the row's token count: a second tensor read inside the vmap.
            ids = (torch.cumsum(attention_mask, -1) > attention_mask.sum(-1, keepdim=True) // 2).long()
            mask_function = masking_utils.or_masks(near, masking_utils.blockwise_overlay(ids))
        batch, length = attention_mask.shape
        mask = masking_utils.sdpa_mask(
            batch_size=batch,
            q_length=length,
            kv_length=length,
            mask_function=mask_function,
            attention_mask=attention_mask.bool() if self.padding else None,
            allow_is_causal_skip=False,
            use_vmap=True,
            device=scores.device,
        )
        return torch.softmax(scores.masked_fill(~mask, -1e4), dim=-1)


def _scores(batch: int = 2, length: int = 7, seed: int = 0, padded: bool = True) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, length, dtype=torch.int64)
    if padded:
        mask[-1, :2] = 0  # a left-padded row
        mask[0, -1] = 0  # and a right-padded one
    return {"scores": torch.randn(batch, 2, length, length, generator=generator), "attention_mask": mask}


mod_index_as_aten_index = NodeRule(
    RuleMeta(
        id="fx/mod-index-as-aten-index",
        why="torch.export.save refuses the flat_apply node that non-strict export records for torch._dynamo's "
        "ModIndex autograd.Function ('Failed serializing node flat_apply in graph'): transformers' masking_utils "
        "vmaps the mask function whenever a model passes and_mask_function / or_mask_function (t5gemma2's "
        "bidirectional sliding window, encoder/ and seq2seq/t5gemma2; moonshine_streaming's encoder windows, "
        "speech_seq2seq/moonshine_streaming), and inside the vmap the padding mask's "
        "padding_mask[batch_idx, kv_idx] runs under TransformGetItemToIndex as ModIndex. The node becomes "
        "aten.index.Tensor(x, indices), which is ModIndex.forward (its vmap rule is generated from it)",
        upstream="torch==2.13.0 _export/serde/serialize.py (no flat_apply serialization; "
        "export/custom_ops.py _call_custom_autograd_function_in_pre_dispatch, _dynamo/"
        "_trace_wrapped_higher_order_op.py ModIndex)",
        backends=("dynamo",),
        needed="the need is saving: tests/rewrites/test_fx_mod_index_as_aten_index.py shows torch.export.save "
        "refusing each Match example without the rule (the harness runs a Dynamo program in memory, unsaved)",
        models=("t5gemma2", "moonshine_streaming"),
        examples=(
            Match(
                lambda: (_VmapMaskAttention(), _scores()),
                "sdpa_mask(use_vmap=True) with a sliding window and left/right padding at 7 tokens; then 12 and "
                "batch 3",
                other_inputs=lambda: _scores(batch=3, length=12, seed=1),
            ),
            Match(
                lambda: (_VmapMaskAttention(window=2, blocks=True), _scores(length=9, seed=2)),
                "or_masks with blockwise_overlay: two tensors indexed inside the vmap; then 4 tokens",
                other_inputs=lambda: _scores(batch=2, length=4, seed=3),
            ),
            NoMatch(
                lambda: (_VmapMaskAttention(padding=False), _scores(padded=False)),
                "sdpa_mask(use_vmap=True) without a padding mask: the vmapped window only compares indices",
            ),
            NoMatch(dense_decoder, "a Llama forward (masks without vmap)"),
        ),
    ),
    predicate=_is_mod_index,
    rewrite=_as_aten_index,
)
