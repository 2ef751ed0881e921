"""xLSTM's mLSTM in inference mode: the per-token recurrence as a `scan` higher-order op.

`xLSTMBackend.forward` (inference mode) runs `wrap_chunkwise_arbitrary_sequence_length`: the chunkwise kernel on
the whole `chunk_size` chunks (itself a Python loop over the chunks), then `mlstm_recurrent_sequence_native`, a
Python loop over the remaining tokens. torch.export unrolls both for the sample, so the program keeps its length:
`Guard failed: input_ids.size()[1] == 8` at 13, 73 and 138 tokens (xlstm and every variant of it). The kernels
are bound into `functools.partial`s in `xLSTMBackend.__init__`, so only a patch of the backend's forward reaches
them.

The replacement scans upstream's own step kernel (`mlstm_recurrent_step_native`, the partial the backend built:
its state dtype and eps) over the tokens, from the same initial states (zeros, or the cache's), with a symbolic
length. Below `chunk_size` tokens eager runs exactly these steps in this order, so the result is the same
numbers; from `chunk_size` on eager takes the chunkwise form of the same recurrence, which the scan matches to
float rounding (2e-7 on the corpus' 73 and 138 tokens). A concrete length (a one-token decode step, a static
export) is declined: upstream's path traces exactly there. On ONNX the scan's inputs are detached
(`scan_mlstm_detached`).
"""

from __future__ import annotations

from typing import Any

import torch

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, MethodPatch
from hfexport.rewrites.rule import PerBackend, RuleMeta
from hfexport.rewrites.rules.patch._detached_scan import cut_from_autograd


def _applies(self: torch.nn.Module, query: torch.Tensor, mode: str | None) -> bool:
    """The inference mode, upstream's partials in place, and a symbolic length (see the module docstring)."""
    kernel = getattr(self, "_inference_fn", None)
    step_kernel = getattr(kernel, "keywords", {}).get("mlstm_step_kernel")
    return (
        "inference" in (mode or self.config.mode)
        and step_kernel is not None
        and isinstance(query.shape[2], torch.SymInt)
    )


def scan_mlstm(
    original: Any,
    self: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    igate: torch.Tensor,
    fgate: torch.Tensor,
    c_initial: torch.Tensor | None = None,
    n_initial: torch.Tensor | None = None,
    m_initial: torch.Tensor | None = None,
    return_last_states: bool | None = None,
    mode: str | None = None,
) -> Any:
    """The backend's inference kernel, scanned over the sequence axis (see the module docstring)."""
    if not _applies(self, query, mode):
        return NOT_APPLICABLE
    kernel = self._inference_fn
    step_kernel = kernel.keywords["mlstm_step_kernel"]
    from torch._higher_order_ops.scan import scan

    batch, heads, _, dim_qk = key.shape
    dim_v = value.shape[-1]
    state_dtype = step_kernel.keywords.get("dtype_state", torch.float32)
    eps = kernel.keywords.get("eps", 1e-6)
    # The initial states as upstream makes them (float32 zeros), cast as its sequence kernel casts them.
    c = c_initial if c_initial is not None else key.new_zeros((batch, heads, dim_qk, dim_v), dtype=torch.float32)
    n = n_initial if n_initial is not None else key.new_zeros((batch, heads, dim_qk), dtype=torch.float32)
    m = m_initial if m_initial is not None else key.new_zeros((batch, heads, 1), dtype=torch.float32)
    init = tuple(s.to(dtype=state_dtype).contiguous() for s in (c, n, m))

    def step(
        carry: tuple[torch.Tensor, torch.Tensor, torch.Tensor], xs: tuple[torch.Tensor, ...]
    ) -> tuple[tuple[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
        q, k, v, i, f = xs
        h, (c, n, m) = step_kernel(
            cstate=carry[0], nstate=carry[1], mstate=carry[2], query=q, key=k, value=v,
            igate=i[..., None], fgate=f[..., None], eps=eps,
        )  # fmt: skip
        return (c, n, m), h

    tokens = tuple(t.movedim(2, 0) for t in (query, key, value, igate, fgate))
    (c, n, m), hidden = scan(step, init, tokens)
    return hidden.movedim(0, 2), (c, n, m)


def scan_mlstm_detached(original: Any, self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """The ONNX variant: the same scan with its inputs cut from autograd (`_detached_scan`: torch.onnx's type
    promotion would take the scan's autograd path, "'SymInt' object has no attribute 'unsqueeze'" on the corpus'
    xlstm)."""
    query, mode = args[0] if args else kwargs["query"], kwargs.get("mode", args[9] if len(args) > 9 else None)
    if not _applies(self, query, mode):
        return NOT_APPLICABLE  # before any detach: a declined call leaves the graph as upstream traces it
    cut = cut_from_autograd
    return scan_mlstm(original, self, *map(cut, args), **{key: cut(value) for key, value in kwargs.items()})


def _xlstm(tokens: int, batch: int = 2) -> tuple[torch.nn.Module, dict[str, Any]]:
    from hfexport.rewrites.example_models import tiny_model

    return tiny_model(
        "xLSTMConfig",
        "xLSTMForCausalLM",
        tokens=tokens,
        batch=batch,
        vocab_size=64,
        hidden_size=32,
        embedding_dim=32,
        num_heads=2,
        num_blocks=2,
        chunk_size=4,
        mode="inference",
        inference_state_dtype="float32",
    )


def _ids(tokens: int, batch: int) -> dict[str, Any]:
    ids = torch.randint(0, 64, (batch, tokens), generator=torch.Generator().manual_seed(tokens))
    return {"input_ids": ids, "use_cache": False}


xlstm_mlstm_scan = MethodPatch(
    RuleMeta(
        id="patch/xlstm-mlstm-scan",
        why="xLSTM exports with the prompt length baked in: its mLSTM (inference mode) runs the chunkwise kernel on "
        "whole chunks and a Python loop over the remaining tokens, both unrolled for the sample ('Guard failed: "
        "input_ids.size()[1] == 8' at 13 tokens); a scan of upstream's own step kernel keeps the length symbolic "
        "(the same steps below chunk_size, the chunkwise form's recurrence to float rounding above)",
        upstream="transformers==5.24.0 models/xlstm/modeling_xlstm.py wrap_chunkwise_arbitrary_sequence_length "
        "and mlstm_recurrent_sequence_native (Python loops; bound into partials in xLSTMBackend.__init__); torch "
        "2.13.0 _higher_order_ops/scan.py autograd path under fake tensors (torch.onnx InsertTypePromotion: the ONNX "
        "variant detaches the scan's inputs)",
        backends=("dynamo", "onnx"),
        models=("xlstm",),
        examples=(
            Match(
                lambda: _xlstm(7),
                "2 blocks, chunk size 4: 7 tokens (one chunk and 3 steps in eager); then 12 tokens, batch 3",
                atol=1e-5,
                other_inputs=lambda: _ids(12, 3),
            ),
            NoMatch(
                lambda: _xlstm(1),
                "a single token (a decode step)",
                reason="the replacement declines a concrete length: upstream's step kernel is exact there",
            ),
        ),
    ),
    target="transformers.models.xlstm.modeling_xlstm.xLSTMBackend.forward",
    replacement=PerBackend(dynamo=scan_mlstm, onnx=scan_mlstm_detached),
)
