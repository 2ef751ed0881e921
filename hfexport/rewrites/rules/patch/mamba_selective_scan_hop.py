"""Mamba-1 selective scan: the sequential recurrence as a higher-order op, one per backend.

transformers' pure-torch `mamba_selective_scan` (copied verbatim into mamba, falcon_mamba, jamba, zamba; `hfexport
scan` finds no other copy in transformers 5.24) runs `for index in range(seq_len)`: torch.export unrolls the loop
and specialises the sequence length to the sample's, so the program rejects every other length. Its
associative-scan path is switched off under export on purpose. The replacement runs the same per-step arithmetic
(`selective_terms`, `finish_selective`: upstream's operands and epilogue) in a loop the export keeps symbolic:

- Dynamo: `torch._higher_order_ops.scan` traces the step once with a symbolic length, bit-identical to eager. The
  step reads the batch size, so the scan takes it as an operand: Inductor, which compiles the program for
  AOTInductor (`--format aoti` runs the Dynamo rules), rewrites a scan into a `while_loop` and sizes its stacked
  outputs from the symbols among the scan's operands only (`decompose_scan_to_while_loop`); without the batch among
  them the compile failed with `InductorError: KeyError: s43`.
- ONNX: the same scan with its inputs detached (`scan_selective_detached`: torch.onnx's type-promotion pass runs
  scan's autograd path otherwise, and fails); torch.onnx translates it to an ONNX `Scan` loop. Without a rule
  falcon_mamba's ONNX model declared `input_ids: [batch, 8]` and ORT rejected the grown input; zamba's declared a
  symbolic length, so ORT accepted a longer prompt and failed inside, in a `Mul` broadcasting 8 by 13.
- OpenVINO: a `while_loop` (`loop_selective`), which the PyTorch frontend translates to an OpenVINO `Loop`
  (`src/frontends/pytorch/src/op/loop.cpp`); the `scan` op does not convert (openvino 2026.4.1 has no translator
  for it: "Conversion is failed for: <built-in function getitem>, scan"). Without a rule OpenVINO keeps no guard,
  so the converted model accepted a longer prompt and failed inside the CPU plugin (`infer_request.cpp:224`, an
  8-step graph fed 13 tokens: mamba, falcon_mamba, zamba in the corpus sweeps). The loop reads step `i` with
  `index_select` and writes its output row with `index_put`. The frontend maps a `while_loop`'s carried inputs one
  to one onto the body's outputs and has no slot for its `additional_inputs` (the tensors a body closes over):
  with them it fails "body_fn must return same number of outputs as carried inputs. Expected 7, got 3". So every
  tensor the body reads is carried and returned unchanged (a clone: torch refuses a body output that aliases its
  input; in OpenVINO a clone is the identity), and a carried view is copied first (`owned_carry`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hfexport.rewrites.example_models import tiny_model
from hfexport.rewrites.examples import Built, Match, NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, ModuleFunctionPatch
from hfexport.rewrites.rule import PerBackend, RuleMeta, ScanCause
from hfexport.rewrites.rules.patch._detached_scan import cut_from_autograd
from hfexport.rewrites.rules.patch._while_loop import owned_carry

# The four copies of the function in transformers 5.24.0, each checked on every backend through the corpus.
_FAMILIES = ("mamba", "falcon_mamba", "jamba", "zamba")


def scan_selective(
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
    *,
    recurrence: Callable[[SelectiveTerms], tuple[torch.Tensor, torch.Tensor]] | None = None,
    **kwargs: Any,
) -> Any:
    """Upstream's selective scan with its loop over the sequence as `recurrence(terms)` (default: `scan_steps`),
    which returns the outputs `[batch, channels, length]` and the last state."""
    if use_mambapy:  # mambapy's pscan has its own (log-depth) structure; leave it alone
        return NOT_APPLICABLE
    terms = selective_terms(hidden_states, dt, A, B, C, delta_bias, delta_softplus)
    outputs, ssm_state = (recurrence or scan_steps)(terms)
    return finish_selective(outputs, ssm_state, hidden_states, D, z, return_last_state)


def scan_steps(terms: SelectiveTerms) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence as a `scan` op: the step traced once, the length symbolic."""
    from torch._higher_order_ops.scan import scan

    # Inductor (AOTInductor, torch.compile of the program) rewrites a scan into a while_loop and sizes the stacked
    # outputs `[length, batch, channels]` from the symbols among the scan's operands: the length is one, the batch
    # is not, and the compile fails with `KeyError: s43`. Reading the batch size inside the step makes the trace
    # lift it as a SymInt operand of the scan; the reshape to the shape the row already has changes no value.
    batch = terms.discrete_A.shape[0]

    def step(state: torch.Tensor, xs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        a, bu, c = xs
        state = a * state + bu
        out = torch.matmul(state.to(terms.input_dtype), c.unsqueeze(-1))
        return state, out[:, :, 0].reshape(batch, -1)

    ssm_state, outputs = scan(
        step, terms.state0(), (terms.discrete_A.movedim(2, 0), terms.deltaB_u.movedim(2, 0), terms.C.movedim(1, 0))
    )
    return outputs.movedim(0, -1), ssm_state


@dataclass
class SelectiveTerms:
    """The per-step operands of transformers' `mamba_selective_scan`, computed as it computes them before its loop."""

    discrete_A: torch.Tensor  # [batch, channels, length, state]
    deltaB_u: torch.Tensor  # [batch, channels, length, state]
    C: torch.Tensor  # [batch, length, state]
    input_dtype: torch.dtype

    def state0(self) -> torch.Tensor:
        # Eager starts from zeros in the input dtype and promotes on the first step; a loop carry must have
        # the promoted dtype from the start (the zeros are exact in either).
        dtype = torch.promote_types(torch.promote_types(self.discrete_A.dtype, self.input_dtype), self.deltaB_u.dtype)
        return torch.zeros_like(self.discrete_A[:, :, 0], dtype=dtype)


def selective_terms(
    hidden_states: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    delta_bias: torch.Tensor | None,
    delta_softplus: bool,
) -> SelectiveTerms:
    """The operands of the recurrence `state = a_t * state + bu_t; y_t = state @ c_t`, as upstream builds them."""
    if delta_bias is not None:
        dt = dt + delta_bias.to(dt.dtype)[..., None]
    if delta_softplus:
        dt = F.softplus(dt)
    B = B.transpose(1, 2)
    C = C.transpose(1, 2)
    discrete_A = torch.exp(A[None, :, None, :] * dt[:, :, :, None])
    deltaB_u = (dt[:, :, :, None] * B[:, None, :, :].float()) * hidden_states[:, :, :, None].float()
    return SelectiveTerms(discrete_A, deltaB_u, C, hidden_states.dtype)


def finish_selective(
    scan_output: torch.Tensor,
    ssm_state: torch.Tensor,
    hidden_states: torch.Tensor,
    D: torch.Tensor | None,
    z: torch.Tensor | None,
    return_last_state: bool,
) -> Any:
    """Upstream's epilogue after the loop: the skip term, the gate, and the optional last state."""
    if D is not None:
        scan_output = scan_output + hidden_states * D[None, :, None]
    if z is not None:
        scan_output = scan_output * F.silu(z)
    if return_last_state:
        return scan_output, ssm_state
    return scan_output


def scan_selective_detached(original: Any, *args: Any, **kwargs: Any) -> Any:
    """The ONNX variant: the scan with its inputs cut from autograd (`_detached_scan`: torch.onnx's type promotion
    would take the scan's autograd path)."""
    return scan_selective(
        original, *map(cut_from_autograd, args), **{k: cut_from_autograd(v) for k, v in kwargs.items()}
    )


def loop_selective(original: Any, *args: Any, **kwargs: Any) -> Any:
    """The OpenVINO variant: the recurrence as a `while_loop` (`while_loop_steps`)."""
    return scan_selective(original, *args, recurrence=while_loop_steps, **kwargs)


def while_loop_steps(terms: SelectiveTerms) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence as a `while_loop`: one step per token, every tensor the body reads carried."""
    from torch._higher_order_ops.while_loop import while_loop

    batch, channels, length, _ = terms.discrete_A.shape
    state0 = terms.state0()
    # Upstream's per-step output is `matmul(state.to(input_dtype), c)`: its dtype is that of the product.
    out_dtype = torch.promote_types(terms.input_dtype, terms.C.dtype)
    outputs0 = terms.discrete_A.new_zeros((length, batch, channels), dtype=out_dtype)
    step0 = torch.zeros((), dtype=torch.int64, device=terms.discrete_A.device)
    steps = torch.full((), length, dtype=torch.int64, device=terms.discrete_A.device)

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
        cond,
        body,
        (
            step0,
            state0,
            outputs0,
            owned_carry(terms.discrete_A),
            owned_carry(terms.deltaB_u),
            owned_carry(terms.C),
            steps,
        ),
    )
    return outputs.movedim(0, -1), ssm_state


def _falcon_mamba(seq_len: int, use_mambapy: bool = False) -> tuple[torch.nn.Module, dict[str, Any]]:
    from transformers import FalconMambaConfig, FalconMambaModel

    torch.manual_seed(0)
    config = FalconMambaConfig(
        vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=1, expand=2, use_falcon_mambapy=use_mambapy
    )
    model = FalconMambaModel(config).eval()
    ids = torch.randint(0, 64, (2, seq_len))
    return model, {"input_ids": ids, "use_cache": False}


def _zamba(tokens: int) -> Built:
    # One Mamba layer with two Mamba heads: the scan's arguments are per-head views.
    model, inputs = tiny_model(
        "ZambaConfig",
        "ZambaModel",
        tokens=tokens,
        vocab_size=64,
        hidden_size=16,
        attention_hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=1,
        layers_block_type=["linear_attention"],
        num_attention_heads=2,
        attention_head_dim=16,
        num_key_value_heads=2,
        n_mamba_heads=2,
        mamba_d_state=4,
        mamba_dt_rank=4,
        use_mamba_kernels=False,
    )
    return model, inputs


def _zamba_example() -> Built:
    """Zamba from 7 tokens: its scan's arguments are per-head views."""
    return _zamba(7)


def _mamba_padded(batch: int, tokens: int) -> dict[str, Any]:
    # The corpus' mamba failed in ORT on its attention_mask input ("invalid dimensions ... attention_mask"): the
    # unrolled loop had fixed the length that the mask shares. A left-padded row checks the mask still applies.
    generator = torch.Generator().manual_seed(1)
    mask = torch.ones(batch, tokens, dtype=torch.long)
    mask[0, :3] = 0
    ids = torch.randint(0, 64, (batch, tokens), generator=generator)
    return {"input_ids": ids, "attention_mask": mask, "use_cache": False}


def _mamba_example() -> Built:
    """Mamba (its own copy of mamba_selective_scan) from 7 tokens with a padding mask."""
    model, _ = tiny_model(
        "MambaConfig", "MambaModel", tokens=7, vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=1
    )
    return model, _mamba_padded(2, 7)


def _longer_zamba() -> dict[str, Any]:
    return {"input_ids": torch.randint(0, 64, (3, 12)), "use_cache": False}


mamba_selective_scan_hop = ModuleFunctionPatch(
    RuleMeta(
        id="patch/mamba-selective-scan-hop",
        why="Mamba-1 models export with the sequence length baked in (`for index in range(seq_len)` in "
        "mamba_selective_scan): Dynamo guards the sample's length; ONNX fixed the sequence axis (ORT rejected "
        "falcon_mamba's grown input and failed in a Mul broadcast on zamba's and jamba's, and on mamba's "
        'attention_mask: "Got invalid dimensions for input: attention_mask"); OpenVINO accepted a longer prompt '
        "and failed in the CPU plugin (infer_request.cpp:224). A higher-order loop keeps the length symbolic with "
        "upstream's arithmetic: a scan op (its inputs detached on ONNX, where torch.onnx's type promotion otherwise "
        "fails with \"AttributeError: 'SymInt' object has no attribute 'unsqueeze'\" in scan's fake kernel; its step "
        "reads the batch size, without which AOTInductor's compile of the scan failed with \"InductorError: KeyError: "
        's43"), and a while_loop on OpenVINO, which has no translator for scan',
        upstream="transformers==5.24.0 models/mamba/modeling_mamba.py mamba_selective_scan (a Python loop over the "
        "sequence: the associative scan is disabled under export); torch 2.13.0 _higher_order_ops/scan.py autograd "
        "path under fake tensors (hit by torch.onnx InsertTypePromotion; nested dynamo cannot fakify a detached view "
        "of symbolic-size storage); openvino 2026.4.1 PyTorch frontend: no `scan` translator, `while_loop` "
        "translated without additional_inputs (src/frontends/pytorch/src/op/loop.cpp); torch 2.13.0 "
        "_inductor/fx_passes/post_grad.py decompose_scan_to_while_loop (binds the output sizes' symbols from the "
        "scan's SymInt operands only)",
        backends=("dynamo", "onnx", "openvino"),
        models=_FAMILIES,
        aliases=("patch/mamba-selective-scan-onnx", "patch/mamba-selective-scan-openvino"),
        scan=(
            ScanCause(
                "mamba-sequential-scan",
                "loop-over-shape",
                ".*selective_scan",
                "a Python loop over the sequence in the Mamba-1 scan: unrolled for the sample's length",
            ),
        ),
        examples=(
            # The ONNX variant's first: the detached scan of per-head views.
            Match(
                _zamba_example,
                "zamba, per-head views as the scan's inputs, odd length, then a longer input through the same program",
                atol=1e-6,
                rtol=1e-6,
                other_inputs=_longer_zamba,
                backends=("onnx",),
            ),
            Match(
                lambda: _falcon_mamba(7),
                "falcon_mamba, odd length, then a longer input through the same program",
                atol=1e-6,
                rtol=1e-6,
                other_inputs=lambda: {"input_ids": torch.randint(0, 64, (3, 12)), "use_cache": False},
            ),
            Match(lambda: _falcon_mamba(1), "a single token", atol=1e-6, rtol=1e-6),
            NoMatch(
                lambda: _falcon_mamba(7, use_mambapy=True),
                "falcon_mamba with use_mambapy=True",
                reason="the replacement leaves mambapy's own scan (config.use_mambapy) to the original",
            ),
            Match(
                _mamba_example,
                "mamba with a left-padded attention_mask, odd length, then 13 tokens and another batch",
                atol=1e-6,
                rtol=1e-6,
                other_inputs=lambda: _mamba_padded(3, 13),
                backends=("onnx",),
            ),
            Match(
                _zamba_example,
                "zamba, per-head views as the loop's inputs, odd length, then a longer input and batch",
                atol=1e-6,
                rtol=1e-6,
                other_inputs=_longer_zamba,
                backends=("openvino",),
            ),
        ),
    ),
    target=tuple(f"transformers.models.{f}.modeling_{f}.mamba_selective_scan" for f in _FAMILIES),
    replacement=PerBackend(dynamo=scan_selective, onnx=scan_selective_detached, openvino=loop_selective),
)
