"""RWKV-4 linear attention: the per-token recurrence as a `scan` higher-order op.

transformers' CPU path `rwkv_linear_attention_cpu` (the CUDA kernel is only taken on CUDA for more than one
token) runs `for current_index in range(seq_length)`, so torch.export unrolls it and the program keeps the
sample's length: the prefill graph exported from an 8-token prompt fails `Guard failed: input_ids.size()[1] == 8`
on any other prompt. `torch._higher_order_ops.scan` traces upstream's loop body once with a symbolic length;
the per-step operations are the same, in the same order, so the numbers are those of eager.

On ONNX the unrolled loop did not fail at export. The corpus' causal LM declared a symbolic length, its
per-token `select`s became `Gather`s at constant indices, ORT's `GatherSliceToSplitFusion` made them one `Split`
into 8 outputs ('node_select_44/GatherSliceToSplitFusion'), and a 13-token prompt failed in ORT ("Cannot split
using values in 'split' attribute ... NumOutputs=8"); this rule's example, without the rule, declares
`input_ids` as [batch, 8] (44 Gathers). With the rule the ONNX graph has two `Scan`s (one per layer), 12 Gathers
and a symbolic length. The scan needs no detach here (unlike the ONNX variant of `patch/mamba-selective-scan-hop`):
torch.onnx's type promotion passes it.
"""

from __future__ import annotations

from typing import Any

import torch

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, ModuleFunctionPatch
from hfexport.rewrites.rule import RuleMeta, ScanCause


def scan_rwkv_linear_attention(
    original: Any,
    time_decay: torch.Tensor,
    time_first: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    state: list[torch.Tensor] | None = None,
    return_state: bool = False,
) -> Any:
    """Upstream's `rwkv_linear_attention_cpu`, scanned over the sequence axis."""
    seq_length = key.shape[1]
    # A concrete length (a one-token decode step, a static export) traces fine: the unrolled loop is exact.
    if not isinstance(seq_length, torch.SymInt):
        return NOT_APPLICABLE
    from torch._higher_order_ops.scan import scan

    if state is None:
        num_state = torch.zeros_like(key[:, 0], dtype=torch.float32)
        den_state = torch.zeros_like(key[:, 0], dtype=torch.float32)
        max_state = torch.zeros_like(key[:, 0], dtype=torch.float32) - 1e38
    else:
        num_state, den_state, max_state = state
    time_decay = -torch.exp(time_decay)
    out_dtype = key.dtype

    def step(
        carry: tuple[torch.Tensor, torch.Tensor, torch.Tensor], xs: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        # Upstream's loop body for one token, in its order of operations.
        num_state, den_state, max_state = carry
        current_key, current_value = xs
        current_key = current_key.float()
        max_for_output = torch.maximum(max_state, current_key + time_first)
        e1 = torch.exp(max_state - max_for_output)
        e2 = torch.exp(current_key + time_first - max_for_output)
        numerator = e1 * num_state + e2 * current_value
        denominator = e1 * den_state + e2
        out = (numerator / denominator).to(out_dtype)
        max_for_state = torch.maximum(max_state + time_decay, current_key)
        e1 = torch.exp(max_state + time_decay - max_for_state)
        e2 = torch.exp(current_key - max_for_state)
        # The carry keeps its dtype at every step (scan requires it); upstream's state is float32 throughout.
        new_num = (e1 * num_state + e2 * current_value).to(num_state.dtype)
        new_den = (e1 * den_state + e2).to(den_state.dtype)
        return (new_num, new_den, max_for_state.to(max_state.dtype)), out

    # scan wants the initial carry laid out as its body returns it: the model hands in strided slices of its
    # state (`state[2][:, :, layer_id]`), so start from contiguous copies (same values).
    init = tuple(s.contiguous() for s in (num_state, den_state, max_state))
    (num_state, den_state, max_state), outputs = scan(step, init, (key.movedim(1, 0), value.movedim(1, 0)))
    output = outputs.movedim(0, 1)
    if return_state or state is not None:
        return output, [num_state, den_state, max_state]
    return output, None


def _rwkv(tokens: int, batch: int = 2) -> tuple[torch.nn.Module, dict[str, Any]]:
    from transformers import RwkvConfig, RwkvModel

    torch.manual_seed(0)
    config = RwkvConfig(
        vocab_size=64, hidden_size=16, num_hidden_layers=2, attention_hidden_size=16, intermediate_size=32
    )
    model = RwkvModel(config).eval()
    # A trained model's time_decay/time_first are not zero; random ones exercise the decay and bonus terms.
    with torch.no_grad():
        for block in model.blocks:
            block.attention.time_decay.normal_(0, 1)
            block.attention.time_first.normal_(0, 1)
    return model, {"input_ids": torch.randint(0, 64, (batch, tokens)), "use_cache": True}


rwkv_linear_attention_scan = ModuleFunctionPatch(
    RuleMeta(
        id="patch/rwkv-linear-attention-scan",
        why="RWKV exports with the prompt length baked in: `rwkv_linear_attention_cpu` loops "
        "`for current_index in range(seq_length)`, which torch.export unrolls, so the prefill program fails "
        "'Guard failed: input_ids.size()[1] == 8' on another prompt length; a scan op keeps the length symbolic "
        "with upstream's per-step arithmetic; on ONNX ORT fused the unrolled per-token Gathers into a Split with 8 "
        "outputs and failed at 13 tokens (\"Cannot split using values in 'split' attribute\")",
        upstream="transformers==5.24.0 models/rwkv/modeling_rwkv.py rwkv_linear_attention_cpu (a Python loop over "
        "the sequence; the CUDA kernel is not traceable); torch._higher_order_ops.scan keeps the length symbolic",
        backends=("dynamo", "onnx"),
        scan=(
            ScanCause(
                "rwkv-token-loop",
                "loop-over-shape",
                "rwkv_linear_attention_cpu",
                "a Python loop over the tokens of RWKV's linear attention (its CPU path): the prompt length is baked "
                "in",
            ),
        ),
        models=("rwkv",),
        examples=(
            Match(
                lambda: _rwkv(7),
                "rwkv with its state (use_cache), odd length, then a longer input and another batch",
                atol=1e-6,
                rtol=1e-6,
                other_inputs=lambda: {"input_ids": torch.randint(0, 64, (3, 12)), "use_cache": True},
            ),
            NoMatch(
                lambda: _rwkv(1),
                "a single token (a decode step)",
                reason="the replacement declines a concrete length: one step of the original loop is exact",
            ),
        ),
    ),
    target="transformers.models.rwkv.modeling_rwkv.rwkv_linear_attention_cpu",
    replacement=scan_rwkv_linear_attention,
)
