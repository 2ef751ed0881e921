"""Experts with zero-compute (identity) experts, looping over the experts hit: one loop bounded by the routed experts.

LongCat-Flash's experts (`LongcatFlashExperts`) route each token to `top_k` of `total_experts = num_routed_experts
+ zero_expert_num` experts; the last `zero_expert_num` are identity experts (`identity_expert`, an `nn.Identity`)
that pass the token through, weighted. The forward loops over `nonzero()` of the experts hit (a data-dependent
count) and calls `.item()` on each; torch.export fails ("Could not guard on data-dependent expression Eq(u0, 0)
... in unbind"). The class has no `use_experts_implementation` decorator, so the routed-experts rules
(`experts.routed_experts_forward`) do not see it.

Here the routed experts run in a loop bounded by `num_routed_experts` (unrolled by the trace): each expert's
(token, slot) pairs come from `nonzero` over the flat routing, their rows from `index_select`, and the weighted
rows are added back with `scatter_add` -- an expert without tokens gets a 0-row matmul. The identity experts need
no matmul: their contributions are added densely, one pass per slot, in the order of their expert index (the
slot with the smallest remaining identity index first), a slot routed elsewhere adding an exact zero. Each pair is
computed as the original computes it (`F.linear` on the same rows, `act_fn(gate) * up`, the product with the
routing weight in the promoted dtype, cast to the hidden dtype before it is added) and each token's contributions
are added in the same order (ascending expert index, routed experts before identity experts, from a zero start in
the hidden dtype), so the result is bit-identical to eager.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F

from hfexport.rewrites.example_models import tiny_model
from hfexport.rewrites.examples import Built, Match, NoMatch
from hfexport.rewrites.kinds.patch import MethodPatch
from hfexport.rewrites.rule import RuleMeta, ScanCause
from hfexport.rewrites.rules._moe_batched import dispatches_experts, qwen3_moe
from hfexport.rewrites.rules.patch._scan_site import class_method_at

_PARAMETERS = ["hidden_states", "top_k_index", "top_k_weights"]


def has_identity_experts(module: torch.nn.Module) -> bool:
    """An experts module whose last `total_experts - num_routed_experts` experts are an identity module.

    By structure: `num_routed_experts`, `total_experts`, an `identity_expert` that is an `nn.Identity`, a
    `gate_up_proj` with `total_experts` rows (or None), a `down_proj` with `num_routed_experts` rows (or None),
    `forward(hidden_states, top_k_index, top_k_weights)`, and no experts dispatch (that form has its own rules).
    """
    routed, total = getattr(module, "num_routed_experts", None), getattr(module, "total_experts", None)
    if not isinstance(routed, int) or not isinstance(total, int) or not 0 <= routed <= total:
        return False
    if not isinstance(getattr(module, "identity_expert", None), torch.nn.Identity) or dispatches_experts(module):
        return False
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    if routed > 0:
        if not isinstance(gate_up, torch.Tensor) or not isinstance(down, torch.Tensor):
            return False
        if gate_up.dim() != 3 or down.dim() != 3 or gate_up.shape[0] != total or down.shape[0] != routed:
            return False
        if gate_up.shape[1] != 2 * down.shape[2] or gate_up.shape[2] != down.shape[1]:
            return False
    elif gate_up is not None or down is not None:
        return False
    try:
        parameters = list(inspect.signature(module.forward).parameters)
    except (TypeError, ValueError):
        return False
    return parameters == _PARAMETERS and hasattr(module, "act_fn")


def covers(module: str, scope: str) -> bool:
    """Whether the rule binds to the class at `module.scope` (for `hfexport scan`): a forward of a class whose
    `__init__` makes an `identity_expert` (the structure `has_identity_experts` checks on instances)."""
    function = class_method_at(module, scope, "forward")
    init = class_method_at(module, scope.rpartition(".")[0] + ".__init__", "__init__") if function else None
    try:
        return init is not None and "self.identity_expert" in inspect.getsource(init)
    except (OSError, TypeError):
        return False


has_identity_experts.scan_kind = "loop-over-nonzero"  # type: ignore[attr-defined]
has_identity_experts.covers = covers  # type: ignore[attr-defined]


def identity_experts_forward(
    original: Any, module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: Any
) -> torch.Tensor:
    """The experts forward without a data-dependent loop; bit-identical to the original (see the module doc)."""
    dtype = hidden_states.dtype
    routed, total = module.num_routed_experts, module.total_experts
    top_k = top_k_index.shape[-1]
    out = torch.zeros_like(hidden_states)
    flat_index, flat_weights = top_k_index.reshape(-1), top_k_weights.reshape(-1)
    for expert in range(routed if module.gate_up_proj is not None else 0):
        pair = torch.nonzero(flat_index == expert).reshape(-1)
        token = torch.div(pair, top_k, rounding_mode="floor")
        gate, up = F.linear(hidden_states.index_select(0, token), module.gate_up_proj[expert]).chunk(2, dim=-1)
        h = F.linear(module.act_fn(gate) * up, module.down_proj[expert])
        weighted = (h * flat_weights.index_select(0, pair).unsqueeze(-1)).to(dtype)
        out = out.scatter_add(0, token.unsqueeze(-1).expand_as(weighted), weighted)
    # Identity experts (indices routed..total-1; all of them when there is no routed weight), in ascending index.
    first_identity = routed if module.gate_up_proj is not None else 0
    identity = (top_k_index >= first_identity) & (top_k_index < total)
    order = torch.where(identity, top_k_index, total)  # routed slots sort last
    for _ in range(top_k):
        slot = order.argmin(dim=-1, keepdim=True)  # [tokens, 1]: the smallest identity index left
        taken = order.gather(-1, slot) < total
        term = (module.identity_expert(hidden_states) * top_k_weights.gather(-1, slot)).to(dtype)
        out = out + torch.where(taken, term, torch.zeros_like(term))
        order = order.scatter(-1, slot, total)
    return out


def _longcat(tokens: int, zero_experts: int = 3, routed: int = 4) -> Built:
    return tiny_model(
        "LongcatFlashConfig",
        "LongcatFlashModel",
        tokens=tokens,
        vocab_size=64,
        hidden_size=16,
        num_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        ffn_hidden_size=32,
        q_lora_rank=8,
        kv_lora_rank=8,
        qk_nope_head_dim=4,
        qk_rope_head_dim=4,
        head_dim=4,
        v_head_dim=8,
        qk_head_dim=8,
        moe_topk=2,
        n_routed_experts=routed,
        zero_expert_num=zero_experts,
        expert_ffn_hidden_size=8,
    )


def _other(tokens: int, batch: int) -> dict[str, Any]:
    ids = torch.randint(0, 64, (batch, tokens), generator=torch.Generator().manual_seed(tokens))
    return {"input_ids": ids, "use_cache": False}


identity_experts_routed_loop = MethodPatch(
    RuleMeta(
        id="patch/identity-experts-routed-loop",
        why="LongCat-Flash does not export: `LongcatFlashExperts.forward` loops over `nonzero()` of the experts hit "
        "and calls `.item()` on each ('Could not guard on data-dependent expression Eq(u0, 0) ... in unbind'); "
        "the class has zero-compute identity experts (gate_up_proj has total_experts rows, down_proj only the "
        "routed ones) and no use_experts_implementation dispatch, so the routed-experts rules do not match. A "
        "loop bounded by the routed experts (nonzero over the flat routing + index_select + scatter_add) and one "
        "dense pass per slot for the identity experts compute each pair and each token's sum in the original's "
        "order: bit-identical to eager. Matched by structure (num_routed_experts, total_experts, an nn.Identity "
        "identity_expert, gate_up_proj/down_proj rows, forward(hidden_states, top_k_index, top_k_weights)); of "
        "the four experts classes in transformers 5.24.0 that loop over `expert_hit` without the dispatch "
        "decorator (hfexport scan) only LongcatFlashExperts has this form: DbrxExperts keeps its weights flat in "
        "`mlp.w1/v1/w2` and has no identity experts, NllbMoeExperts and SwitchTransformersExperts have their own "
        "rules",
        upstream="transformers==5.24.0 models/longcat_flash/modeling_longcat_flash.py LongcatFlashExperts.forward "
        "(`for expert_idx_tensor in expert_hit: int(expert_idx_tensor.item())`)",
        # ExecuTorch: the gate/up split of a routed expert's rows has a data-dependent length (as in
        # patch/moe-batched-experts).
        requires=("executorch/split-as-slices",),
        scan=(
            ScanCause(
                "experts-hit-loop",
                "loop-over-nonzero",
                "forward",
                "an experts forward without the experts dispatch loops over `nonzero()` of the experts hit: a "
                "data-dependent count (Eq(u0, 0)) as soon as an expert gets no token",
            ),
        ),
        models=("longcat_flash",),
        examples=(
            Match(
                lambda: _longcat(7),
                "4 routed and 3 identity experts, 7 tokens, then 12 tokens and a batch of 3",
                other_inputs=lambda: _other(12, 3),
                known_failure={
                    "executorch": "ExecuTorch plans the LongCat program for the sample's batch of 2 (shape bound "
                    "[2, 7]), so the example's other inputs of batch 3 are refused: a coverage gap (#17), as for "
                    "patch/minimax-m3-index-blocks"
                },
            ),
            Match(lambda: _longcat(1, zero_experts=6), "a single token: most experts get no rows"),
            Match(
                lambda: _longcat(6, zero_experts=0),
                "zero_expert_num=0: routed experts only (the same data-dependent loop)",
            ),
            NoMatch(
                lambda: qwen3_moe(5),
                "Qwen3-MoE: experts with the use_experts_implementation dispatch and no identity expert",
                reason="the predicate matches only experts modules with an nn.Identity `identity_expert` and no "
                "experts dispatch, and the replacement declines nothing a trace reaches (every routing is computed), "
                "so the rule is not installed on a model without such experts",
                applies=False,
            ),
        ),
    ),
    target=has_identity_experts,
    method="forward",
    replacement=identity_experts_forward,
)
