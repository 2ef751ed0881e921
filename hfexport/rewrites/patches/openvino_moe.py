"""Mixture-of-experts for OpenVINO: run transformers' `grouped_mm` experts as `batched_mm` during the trace."""

from __future__ import annotations

from typing import Any

import torch

from hfexport.rewrites.example_models import dense_decoder, tiny_model
from hfexport.rewrites.examples import Built, Match, NoMatch
from hfexport.rewrites.patching import NOT_APPLICABLE, MethodPatch
from hfexport.rewrites.rule import RuleMeta


def _is_dispatching_experts(module: torch.nn.Module) -> bool:
    # Classes decorated with transformers' `use_experts_implementation` get these attributes in __init__ and a
    # forward that dispatches on `config._experts_implementation`.
    return all(hasattr(module, a) for a in ("_is_expert_parallel", "has_gate", "is_transposed", "config"))


def batched_experts(original: Any, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    from transformers.integrations import moe

    if (
        getattr(module.config, "_experts_implementation", None) != "grouped_mm"
        or moe.ALL_EXPERTS_FUNCTIONS.get("grouped_mm") is not moe.grouped_mm_experts_forward
        or module._is_expert_parallel
    ):
        return NOT_APPLICABLE
    # Same per (token, expert) products, gating, routing weights and per-token sum as grouped_mm, without the
    # sort, histc offsets and inverse permutation that OpenVINO cannot convert.
    return moe.batched_mm_experts_forward(module, *args, **kwargs)


def _moe(tokens: int, experts: int = 4, implementation: str | None = None) -> Built:
    model, inputs = tiny_model(
        "Qwen3MoeConfig",
        "Qwen3MoeModel",
        tokens=tokens,
        batch=2,
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=experts,
        num_experts_per_tok=2,
    )
    if implementation is not None:
        model.set_experts_implementation(implementation)
    return model, inputs


def _gpt_oss(tokens: int) -> Built:
    # Biased, transposed experts with their own gate: the other layout batched_mm must reproduce.
    return tiny_model(
        "GptOssConfig",
        "GptOssModel",
        tokens=tokens,
        batch=2,
        vocab_size=64,
        hidden_size=16,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        num_local_experts=4,
        num_experts_per_tok=2,
        layer_types=["full_attention"],
    )


openvino_batched_experts = MethodPatch(
    RuleMeta(
        id="patch/openvino-moe-batched-experts",
        why="openvino.convert_model has no conversion rule for aten.histc and aten.empty_permuted, which "
        "transformers' grouped_mm experts forward uses for its expert offsets and inverse permutation; the "
        "batched_mm forward computes the same per-token expert products with gathers and bmm",
        upstream="openvino 2026.4.1 PyTorch frontend: no translator for aten.histc / aten.empty_permuted "
        "(transformers integrations/moe.py grouped_mm_experts_forward)",
        backends=("openvino",),
        models=("qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss", "granitemoehybrid"),
        examples=(
            Match(
                lambda: _moe(7),
                "odd token count, 4 experts, then another batch and length",
                other_inputs=lambda: {"input_ids": torch.randint(0, 64, (3, 4)), "use_cache": False},
            ),
            Match(lambda: _moe(1, experts=8), "a single token: most experts get no rows"),
            Match(lambda: _gpt_oss(5), "transposed experts with biases"),
            NoMatch(lambda: _moe(5, implementation="batched_mm"), "experts already set to batched_mm"),
            NoMatch(dense_decoder, "a dense model"),
        ),
    ),
    target=_is_dispatching_experts,
    method="forward",
    replacement=batched_experts,
)
