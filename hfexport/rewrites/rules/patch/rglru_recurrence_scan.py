"""RecurrentGemma's RG-LRU recurrence (`_rnn_scan`) as a `scan` higher-order op.

`RecurrentGemmaRglru._rnn_scan` runs the linear recurrence `h_t = a_t * h_{t-1} + x_t` in "linear mode" (more
than one token) as `for t in range(hidden_states.shape[1])`, which torch.export unrolls: the prefill program
exported from an 8-token prompt fails `Guard failed: input_ids.size()[1] == 8` on any other length (the corpus'
causal_lm/recurrent_gemma on Dynamo; its ONNX model inherits the fixed axis). `torch._higher_order_ops.scan` traces
the loop body once with a symbolic length; every step does upstream's operations in upstream's order and dtypes
(the gate and the input cast to the float32 accumulator, the output row cast back to the input's dtype), so the
numbers are those of eager. The reset at segment starts (position 0) is upstream's `recurrent_gate * ~reset`,
computed before the loop as upstream does; the returned state is the scan's final carry, as upstream returns its
last `recurrent_states`.

The rule matches a module by its code, not its class name: a class whose `_rnn_scan` is upstream's (the same
syntax tree, docstring aside: `_recurrent_gemma._UPSTREAM`) is patched; any other `_rnn_scan` keeps its own. A
single token (the decode step) and any concrete length (a static export) are declined: the original's one step or
unrolled loop is exact there.

On OpenVINO, whose PyTorch frontend has no translator for the `scan` op, the loop is a
`torch._higher_order_ops.while_loop` instead (`loop_rnn`, as `patch/mamba-selective-scan-hop` does for Mamba), which
the frontend translates to an OpenVINO `Loop`: one step per token, with upstream's operations in upstream's order and
dtypes, reading step `i` with `index_select` and writing its output row with `index_put`. Every tensor the body reads
is carried and returned unchanged (a clone), since the frontend has no slot for a while_loop's `additional_inputs`.

`hfexport scan` over transformers 5.24 finds this loop (`loop-over-shape` in `_rnn_scan`) in recurrent_gemma only. The
other untargeted per-token loops it lists are other recurrences, not copies: `recurrent_kimi_delta_attention`
(bailing_hybrid, glm5_next, kimi_linear), `torch_recurrent_gated_delta_rule` (lara_mini, olmo_hybrid, qwen3_5,
qwen3_5_moe, qwen3_next, qwen4_exp), MiniMaxLightningAttention.forward and xlstm's
`mlstm_recurrent_sequence_native`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, MethodPatch
from hfexport.rewrites.rule import PerBackend, RuleMeta, ScanCause
from hfexport.rewrites.rules.patch._recurrent_gemma import recurrent_gemma_example, runs_rglru_loop
from hfexport.rewrites.rules.patch._while_loop import owned_carry


def initial_state(
    hidden_states: torch.Tensor,
    recurrent_gate: torch.Tensor,
    reset: torch.Tensor,
    recurrent_states: torch.Tensor | None,
    acc_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reset gate and the loop's starting state, as upstream's `_rnn_scan` prepares them (for the scan and the
    while_loop)."""
    # Upstream's order: the reset first, then (more than one token) the state, zero when there is none.
    recurrent_gate = recurrent_gate * ~reset
    if recurrent_states is None:
        recurrent_states = torch.zeros(hidden_states[:, 0].shape, dtype=acc_dtype, device=hidden_states.device)
    # The carry keeps its dtype at every step (a loop carry must): upstream's state is acc_dtype throughout, or,
    # for a given state of a wider dtype, the promotion of both from its first step on (`.type(acc_dtype) *` it).
    state = recurrent_states.to(recurrent_gate.device)
    return recurrent_gate, state.to(torch.promote_types(acc_dtype, state.dtype))


def scan_rnn(
    original: Any,
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    recurrent_gate: torch.Tensor,
    reset: torch.Tensor,
    recurrent_states: torch.Tensor | None,
    acc_dtype: torch.dtype = torch.float32,
    *,
    recurrence: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> Any:
    """Upstream's linear mode with its loop over the sequence axis as `recurrence(gate, inputs, state, acc_dtype)`
    (default: `scan_steps`; a symbolic length only)."""
    if not isinstance(hidden_states.shape[1], torch.SymInt):
        return NOT_APPLICABLE
    recurrent_gate, state = initial_state(hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype)
    return (recurrence or scan_steps)(recurrent_gate, hidden_states, state, acc_dtype)


def scan_steps(
    recurrent_gate: torch.Tensor, hidden_states: torch.Tensor, init: torch.Tensor, acc_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence as a `scan` op: the outputs (batch-major, as upstream's) and the last state."""
    from torch._higher_order_ops.scan import scan

    out_dtype = hidden_states.dtype

    def step(state: torch.Tensor, xs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        gate, inputs = xs
        state = gate.type(acc_dtype) * state
        state = state + inputs.type(acc_dtype)
        # Upstream's output row is `state.type(hidden_states.dtype)`; a copy, since a scan's output may not alias
        # its carry (when the dtypes are the same `.type` returns the state itself). The values are the same.
        return state, state.to(out_dtype, copy=True)

    # A copy made in the trace: a state the module kept from an earlier eager call is a real tensor, which the
    # scan cannot take as its carry ("Cannot access data pointer of Tensor" in generation's prefill).
    init = init.clone(memory_format=torch.contiguous_format)
    # Not detached (unlike the ONNX variant of patch/mamba-selective-scan-hop): torch.onnx's type promotion passes
    # this scan, as it does RWKV's (the ONNX example and the corpus model export and run in ORT without a detach).
    state, outputs = scan(step, init, (recurrent_gate.movedim(1, 0), hidden_states.movedim(1, 0)))
    return outputs.movedim(0, 1), state


def loop_rnn(original: Any, self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The OpenVINO variant: the recurrence as a `while_loop` (`while_loop_steps`)."""
    return scan_rnn(original, self, *args, recurrence=while_loop_steps, **kwargs)


def while_loop_steps(
    recurrent_gate: torch.Tensor, hidden_states: torch.Tensor, state0: torch.Tensor, acc_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence as a `while_loop`: one step per token, every tensor the body reads carried."""
    from torch._higher_order_ops.while_loop import while_loop

    state0 = owned_carry(state0)
    out_dtype = hidden_states.dtype
    # Upstream's output starts as zeros_like(hidden_states) and gets every row: time-major here, moved back after.
    outputs0 = hidden_states.new_zeros((hidden_states.shape[1], hidden_states.shape[0], *hidden_states.shape[2:]))
    step0 = torch.zeros((), dtype=torch.int64, device=hidden_states.device)
    steps = torch.full((), hidden_states.shape[1], dtype=torch.int64, device=hidden_states.device)

    def cond(i: torch.Tensor, state: Any, outputs: Any, gate: Any, inputs: Any, n: torch.Tensor) -> torch.Tensor:
        return i < n

    def body(
        i: torch.Tensor,
        state: torch.Tensor,
        outputs: torch.Tensor,
        gate: torch.Tensor,
        inputs: torch.Tensor,
        n: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        at = i.reshape(1)
        state = gate.index_select(0, at).squeeze(0).type(acc_dtype) * state
        state = state + inputs.index_select(0, at).squeeze(0).type(acc_dtype)
        outputs = outputs.index_put((at,), state.type(out_dtype).unsqueeze(0))
        return i + 1, state, outputs, gate.clone(), inputs.clone(), n.clone()

    carried = (
        step0,
        state0,
        outputs0,
        owned_carry(recurrent_gate.movedim(1, 0)),
        owned_carry(hidden_states.movedim(1, 0)),
        steps,
    )
    _, state, outputs, *_ = while_loop(cond, body, carried)
    return outputs.movedim(0, 1), state


def _positions(batch: int, tokens: int, restart: int) -> torch.Tensor:
    # Two segments in one row: positions restart at 0 at `restart`, where upstream resets the recurrence.
    positions = torch.arange(tokens).repeat(batch, 1)
    positions[0, restart:] = torch.arange(tokens - restart)
    return positions


_EXAMPLES = (
    Match(
        lambda: recurrent_gemma_example(7, use_cache=True),
        "recurrent_gemma causal LM (its state set up: use_cache), odd length, then 13 tokens and another batch",
        atol=1e-5,
        rtol=1e-5,
        other_inputs=lambda: {"input_ids": torch.randint(0, 64, (3, 13)), "use_cache": True},
        backends=("dynamo", "onnx"),
    ),
    Match(
        lambda: recurrent_gemma_example(9, use_cache=False, position_ids=_positions(2, 9, 4)),
        "no cache (no initial state) and a second segment in the first row: the recurrence resets at position 0",
        atol=1e-5,
        rtol=1e-5,
        other_inputs=lambda: {
            "input_ids": torch.randint(0, 64, (3, 16)),
            "use_cache": False,
            "position_ids": _positions(3, 16, 11),
        },
        # The OpenVINO conversions of a RecurrentGemma take 34-36 s on the 2-core CI machine: the loop's numbers are
        # checked in the default tier by the first Match (the same recurrence, the same model) on Dynamo.
        slow=True,
    ),
    NoMatch(
        lambda: recurrent_gemma_example(1),
        "a single token (a decode step)",
        reason="the replacement declines a concrete length: upstream's one-token step is exact",
        backends=("dynamo", "onnx"),
    ),
    # OpenVINO: without a cache, since a DynamicCache's first update concatenates onto `torch.tensor([])`, which
    # OpenVINO converts only with openvino/cat-drop-legacy-empty, a rule the example check leaves off (the corpus
    # sweep runs both, with the cache).
    Match(
        lambda: recurrent_gemma_example(7),
        "recurrent_gemma causal LM without a cache, odd length, then 13 tokens and another batch",
        atol=1e-5,
        rtol=1e-5,
        other_inputs=lambda: {"input_ids": torch.randint(0, 64, (3, 13)), "use_cache": False},
        backends=("openvino",),
        slow=True,  # as above
    ),
    NoMatch(
        lambda: recurrent_gemma_example(1),
        "a single token (a decode step), on OpenVINO",
        reason="the replacement declines a concrete length: upstream's one-token step is exact",
        backends=("openvino",),
        slow=True,  # as above
    ),
)


rglru_recurrence_scan = MethodPatch(
    RuleMeta(
        id="patch/rglru-recurrence-scan",
        why="RecurrentGemma exports with the prompt length baked in: the RG-LRU's `_rnn_scan` loops `for t in "
        "range(hidden_states.shape[1])`, which torch.export unrolls, so the prefill program fails 'Guard failed: "
        "input_ids.size()[1] == 8' at 13, 73 and 138 tokens (corpus causal_lm/recurrent_gemma), and the OpenVINO "
        "model, which keeps no guard, matched eager at the sample's 8 tokens and failed in the CPU plugin at 13, 73 "
        "and 138 (infer_request.cpp:224). A scan op keeps the length symbolic with upstream's per-step arithmetic "
        "and dtypes; on OpenVINO, which has no translator for scan, a while_loop (an OpenVINO Loop)",
        upstream="transformers==5.24.0 models/recurrent_gemma/modeling_recurrent_gemma.py RecurrentGemmaRglru."
        "_rnn_scan (a Python loop over the sequence); torch._higher_order_ops.scan keeps the length symbolic; "
        "openvino 2026.4.1 PyTorch frontend: no `scan` translator, `while_loop` translated without "
        "additional_inputs (src/frontends/pytorch/src/op/loop.cpp)",
        backends=("dynamo", "onnx", "openvino"),
        models=("recurrent_gemma",),
        aliases=("patch/rglru-recurrence-openvino",),
        scan=(
            ScanCause(
                "rglru-token-loop",
                "loop-over-shape",
                "_rnn_scan",
                "a Python loop over the tokens of RecurrentGemma's RG-LRU recurrence: the prompt length is baked in",
            ),
        ),
        examples=_EXAMPLES,
    ),
    target=runs_rglru_loop,
    method="_rnn_scan",
    replacement=PerBackend(dynamo=scan_rnn, onnx=scan_rnn, openvino=loop_rnn),
)
