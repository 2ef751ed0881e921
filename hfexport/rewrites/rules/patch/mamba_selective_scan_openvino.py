"""Mamba-1 selective scan for the OpenVINO backend: the sequential recurrence as a `while_loop`.

transformers' `mamba_selective_scan` runs `for index in range(seq_len)`, which torch.export unrolls for the
sample's length. OpenVINO keeps no guard, so the converted model accepted a longer prompt and failed inside the
CPU plugin (`infer_request.cpp:224`, an 8-step graph fed 13 tokens: mamba, falcon_mamba, zamba in the corpus
sweeps). `patch/mamba-selective-scan-hop`'s `scan` op does not convert (openvino 2026.4.1 has no translator for
`scan`: "Conversion is failed for: <built-in function getitem>, scan"), but the PyTorch frontend translates
`torch._higher_order_ops.while_loop` to an OpenVINO `Loop` (`src/frontends/pytorch/src/op/loop.cpp`). The loop
runs the same per-step arithmetic as upstream (one step per token, same operand order), reading step `i` with
`index_select` and writing its output row with `index_put`.

The frontend maps a `while_loop`'s carried inputs one to one onto the body's outputs and has no slot for its
`additional_inputs` (the tensors a body closes over): with them it fails "body_fn must return same number of
outputs as carried inputs. Expected 7, got 3". So every tensor the body reads is carried and returned unchanged
(a clone: torch refuses a body output that aliases its input; in OpenVINO a clone is the identity), and a
carried view is copied first (the body's clone is contiguous, and a carry must keep its strides).
"""

from __future__ import annotations

from typing import Any

import torch

from hfexport.rewrites.examples import Match
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, ModuleFunctionPatch
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.patch.mamba_selective_scan_hop import EXAMPLES, finish_selective, selective_terms
from hfexport.rewrites.rules.patch.mamba_selective_scan_onnx import zamba_example

# The four copies of the function in transformers 5.24.0 (`hfexport scan`: cause mamba-sequential-scan).
_FAMILIES = ("mamba", "falcon_mamba", "jamba", "zamba")


def _own(value: torch.Tensor) -> torch.Tensor:
    # A carried input must have the strides of the body's output for it (a clone, contiguous): C arrives
    # transposed, and zamba passes per-head slices, windows into storage whose size is an expression of the
    # outer trace's symbols. A contiguous copy owns its storage; the values are the same.
    if value._is_view() or not value.is_contiguous():
        return value.clone(memory_format=torch.contiguous_format)
    return value


def loop_selective(
    original: Any,
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    use_mambapy: bool = False,
    use_associative_scan: bool = False,
    **kwargs: Any,
) -> Any:
    if use_mambapy:  # mambapy's pscan has its own (log-depth) structure; leave it alone
        return NOT_APPLICABLE
    from torch._higher_order_ops.while_loop import while_loop

    terms = selective_terms(hidden_states, dt, A, B, C, delta_bias, delta_softplus)
    batch, channels, length, _ = terms.discrete_A.shape
    state0 = terms.state0()
    # Upstream's per-step output is `matmul(state.to(input_dtype), c)`: its dtype is that of the product.
    out_dtype = torch.promote_types(terms.input_dtype, terms.C.dtype)
    outputs0 = terms.discrete_A.new_zeros((length, batch, channels), dtype=out_dtype)
    step0 = torch.zeros((), dtype=torch.int64, device=hidden_states.device)
    steps = torch.full((), length, dtype=torch.int64, device=hidden_states.device)

    def cond(i: torch.Tensor, state: Any, outputs: Any, a: Any, bu: Any, c: Any, n: torch.Tensor) -> torch.Tensor:
        return i < n

    def body(
        i: torch.Tensor,
        state: torch.Tensor,
        outputs: torch.Tensor,
        a: torch.Tensor,
        bu: torch.Tensor,
        c: torch.Tensor,
        n: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        at = i.reshape(1)
        state = a.index_select(2, at).squeeze(2) * state + bu.index_select(2, at).squeeze(2)
        out = torch.matmul(state.to(terms.input_dtype), c.index_select(1, at).squeeze(1).unsqueeze(-1))
        outputs = outputs.index_put((at,), out[:, :, 0].unsqueeze(0))
        return i + 1, state, outputs, a.clone(), bu.clone(), c.clone(), n.clone()

    _, ssm_state, outputs, *_ = while_loop(
        cond, body, (step0, state0, outputs0, _own(terms.discrete_A), _own(terms.deltaB_u), _own(terms.C), steps)
    )
    return finish_selective(outputs.movedim(0, -1), ssm_state, hidden_states, D, z, return_last_state)


mamba_selective_scan_openvino = ModuleFunctionPatch(
    RuleMeta(
        id="patch/mamba-selective-scan-openvino",
        why="Mamba-1 OpenVINO models kept the sample's length (the loop in mamba_selective_scan unrolled): a longer "
        "prompt fails in the CPU plugin (infer_request.cpp:224; mamba, falcon_mamba, zamba); the scan op of "
        "patch/mamba-selective-scan-hop does not convert (no translator for `scan`), a while_loop converts to an "
        "OpenVINO Loop",
        upstream="transformers==5.24.0 models/mamba/modeling_mamba.py mamba_selective_scan (a Python loop over the "
        "sequence); openvino 2026.4.1 PyTorch frontend: no `scan` translator, `while_loop` translated without "
        "additional_inputs (src/frontends/pytorch/src/op/loop.cpp)",
        backends=("openvino",),
        models=_FAMILIES,
        # falcon_mamba first (the default test tier runs the first Match), then zamba's per-head views.
        examples=(
            *EXAMPLES,
            Match(
                zamba_example,
                "zamba, per-head views as the loop's inputs, odd length, then a longer input and batch",
                atol=1e-6,
                rtol=1e-6,
                other_inputs=lambda: {"input_ids": torch.randint(0, 64, (3, 12)), "use_cache": False},
            ),
        ),
    ),
    target=tuple(f"transformers.models.{f}.modeling_{f}.mamba_selective_scan" for f in _FAMILIES),
    replacement=loop_selective,
)
