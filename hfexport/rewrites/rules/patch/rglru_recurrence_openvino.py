"""RecurrentGemma's RG-LRU recurrence for the OpenVINO backend: upstream's loop as a `while_loop`.

`patch/rglru-recurrence-scan` is scoped to Dynamo and ONNX: OpenVINO's PyTorch frontend has no translator for the
`scan` op, so an OpenVINO export traced upstream's unrolled `for t in range(hidden_states.shape[1])` and kept the
sample's length (see `why`). As `patch/mamba-selective-scan-openvino` does for Mamba, the loop becomes a
`torch._higher_order_ops.while_loop`, which the frontend translates to an OpenVINO `Loop`: one step per token, with
upstream's operations in upstream's order and dtypes, reading step `i` with `index_select` and writing its output
row with `index_put`. Every tensor the body reads is carried and returned unchanged (a clone), since the frontend
has no slot for a while_loop's `additional_inputs`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from hfexport.rewrites.examples import Match
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, MethodPatch
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.patch.mamba_selective_scan_openvino import _own
from hfexport.rewrites.rules.patch.rglru_recurrence_scan import (
    EXAMPLES,
    _recurrent_gemma,
    initial_state,
    runs_rglru_loop,
)


def loop_rnn(
    original: Any,
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    recurrent_gate: torch.Tensor,
    reset: torch.Tensor,
    recurrent_states: torch.Tensor | None,
    acc_dtype: torch.dtype = torch.float32,
) -> Any:
    """Upstream's linear mode as a while_loop over the sequence axis (a symbolic length only)."""
    if not isinstance(hidden_states.shape[1], torch.SymInt):
        return NOT_APPLICABLE
    from torch._higher_order_ops.while_loop import while_loop

    recurrent_gate, state0 = initial_state(hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype)
    state0 = _own(state0)
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

    carried = (step0, state0, outputs0, _own(recurrent_gate.movedim(1, 0)), _own(hidden_states.movedim(1, 0)), steps)
    _, state, outputs, *_ = while_loop(cond, body, carried)
    return outputs.movedim(0, 1), state


rglru_recurrence_openvino = MethodPatch(
    RuleMeta(
        id="patch/rglru-recurrence-openvino",
        why="RecurrentGemma's OpenVINO model kept the sample's length (the RG-LRU loop in _rnn_scan unrolled: "
        "patch/rglru-recurrence-scan's scan op has no OpenVINO translator): the corpus' causal_lm/recurrent_gemma "
        "matched eager at the sample's 8 tokens (3.6e-07) and failed in the CPU plugin at 13, 73 and 138 "
        "(infer_request.cpp:224); a while_loop converts to an OpenVINO Loop",
        upstream="transformers==5.24.0 models/recurrent_gemma/modeling_recurrent_gemma.py RecurrentGemmaRglru."
        "_rnn_scan (a Python loop over the sequence); openvino 2026.4.1 PyTorch frontend: no `scan` translator, "
        "`while_loop` translated without additional_inputs (src/frontends/pytorch/src/op/loop.cpp)",
        backends=("openvino",),
        models=("recurrent_gemma",),
        # Without a cache: a DynamicCache's first update concatenates onto `torch.tensor([])`, which OpenVINO
        # converts only with openvino/cat-drop-legacy-empty, a rule the example check leaves off (the corpus
        # sweep runs both, with the cache).
        examples=(
            Match(
                lambda: _recurrent_gemma(7),
                "recurrent_gemma causal LM without a cache, odd length, then 13 tokens and another batch",
                atol=1e-5,
                rtol=1e-5,
                other_inputs=lambda: {"input_ids": torch.randint(0, 64, (3, 13)), "use_cache": False},
                # The OpenVINO conversions of a RecurrentGemma take 36 s and 34 s on the 2-core CI machine; the loop's
                # numbers are checked in the default tier by patch/rglru-recurrence-scan's first Match.
                slow=True,
            ),
            EXAMPLES[1],
            dataclasses.replace(EXAMPLES[2], slow=True),
        ),
    ),
    target=runs_rglru_loop,
    method="_rnn_scan",
    replacement=loop_rnn,
)
