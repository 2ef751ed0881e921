"""transformers' `grouped_mm` experts run one expert at a time over the tokens routed to it during the trace.

The body, target and examples of `patch/moe-batched-experts`, and the tiny MoE models other rules' examples use
(`patch/identity-experts-routed-loop`, `aten/grouped-mm-fallback`).
"""

from __future__ import annotations

from typing import Any

import torch

from hfexport.rewrites.example_models import tiny_model
from hfexport.rewrites.examples import Built, Match, NoMatch
from hfexport.rewrites.experts import routed_experts_forward
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE

MODELS = ("qwen3_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss", "granitemoehybrid")


def dispatches_experts(module: torch.nn.Module) -> bool:
    # transformers' `use_experts_implementation` decorator gives an experts class these attributes and a
    # forward that dispatches on `config._experts_implementation`.
    return all(hasattr(module, a) for a in ("_is_expert_parallel", "has_gate", "is_transposed", "config"))


def _declines(module: torch.nn.Module) -> bool:
    from transformers.integrations import moe

    return (
        getattr(module.config, "_experts_implementation", None) != "grouped_mm"
        or moe.ALL_EXPERTS_FUNCTIONS.get("grouped_mm") is not moe.grouped_mm_experts_forward
        or module._is_expert_parallel
    )


def routed_experts(original: Any, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    # No sort or histc (refused by OpenVINO's converter and by to_edge) and no grouped_mm kernel (none in XNNPACK
    # or the portable kernels).
    if _declines(module):
        return NOT_APPLICABLE
    return routed_experts_forward(module, *args, **kwargs)


def qwen3_moe(tokens: int, experts: int = 4, implementation: str | None = None) -> Built:
    model, inputs = tiny_model(
        "Qwen3MoeConfig",
        "Qwen3MoeModel",
        tokens=tokens,
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


def gpt_oss(tokens: int) -> Built:
    # Transposed experts with biases and their own gate: the other weight layout batched_mm must reproduce.
    return tiny_model(
        "GptOssConfig",
        "GptOssModel",
        tokens=tokens,
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


EXAMPLES = (
    Match(
        lambda: qwen3_moe(7),
        "odd token count, 4 experts, then another batch and length",
        other_inputs=lambda: {"input_ids": torch.randint(0, 64, (3, 4)), "use_cache": False},
    ),
    Match(lambda: qwen3_moe(1, experts=8), "a single token: most experts get no rows"),
    # ExecuTorch: gpt_oss's attention sinks take a max over the heads that XNNPACK's amax refuses.
    Match(lambda: gpt_oss(5), "transposed experts with biases", needs=("executorch/max-values-as-amax",)),
    NoMatch(
        lambda: qwen3_moe(5, implementation="batched_mm"),
        "experts already set to batched_mm",
        reason="the replacement declines experts whose implementation is not grouped_mm",
    ),
)
