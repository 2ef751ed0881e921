"""Mamba-1 selective scan for the ONNX backend: the `scan` of `patch/mamba-selective-scan-hop`, detached.

That rule is scoped to the dynamo backend, so an ONNX export captured transformers' unrolled
`for index in range(seq_len)` loop, which specialises the sequence axis to the sample length (falcon_mamba's
ONNX model declared `input_ids: [batch, 8]` and ORT rejected the grown input; zamba's declared a symbolic
length, so ORT accepted a longer prompt and failed inside, in a `Mul` broadcasting 8 by 13). With the scan op
instead, torch.onnx's type-promotion pass (step 2/3) failed on it (see `scan_selective_detached`); with the
scan's inputs detached, torch.onnx translates it to an ONNX `Scan` loop.
"""

from __future__ import annotations

from typing import Any

import torch

from hfexport.rewrites.example_models import tiny_model
from hfexport.rewrites.examples import Built, Match
from hfexport.rewrites.kinds.patch import ModuleFunctionPatch
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.patch.mamba_selective_scan_hop import EXAMPLES, scan_selective

# The families checked in ORT: falcon_mamba and mamba through the corpus, zamba through the corpus and the
# generation sweep, jamba through the corpus (causal_lm and encoder). `hfexport scan` finds no other modeling
# file with a `def mamba_selective_scan` (transformers 5.24).
_VERIFIED = ("mamba", "falcon_mamba", "jamba", "zamba")


def scan_selective_detached(original: Any, *args: Any, **kwargs: Any) -> Any:
    # torch.onnx's type-promotion pass re-runs the program on fake tensors with grad enabled and the
    # parameters requiring grad; the scan op then takes its autograd path, whose fake kernel stacks the
    # SymInts it saves for backward as if they were per-step outputs (AttributeError: 'SymInt' object has
    # no attribute 'unsqueeze'). Inputs cut from autograd keep the scan on its inference path; detach
    # changes no value.
    #
    # A detached *view* (zamba passes per-head slices such as `C[head_idx].transpose(1, 2)`) is no longer a
    # view but still a window into its base's storage, whose size is an expression in the outer trace's
    # symbols; the scan compiles its body with a nested dynamo that fakifies the window through that storage
    # and fails ("vr must not be None for symbol s43"). A copy owns its storage; the values are the same.
    def cut(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        return value.detach().clone() if value._is_view() else value.detach()

    return scan_selective(original, *map(cut, args), **{k: cut(v) for k, v in kwargs.items()})


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


def zamba_example() -> Built:
    """Zamba from 7 tokens: the first example of this rule and of `patch/mamba-selective-scan-openvino`."""
    return _zamba(7)


def _mamba_padded(batch: int, tokens: int) -> dict[str, Any]:
    # The corpus' mamba failed in ORT on its attention_mask input ("invalid dimensions ... attention_mask"): the
    # unrolled loop had fixed the length that the mask shares. A left-padded row checks the mask still applies.
    generator = torch.Generator().manual_seed(1)
    mask = torch.ones(batch, tokens, dtype=torch.long)
    mask[0, :3] = 0
    ids = torch.randint(0, 64, (batch, tokens), generator=generator)
    return {"input_ids": ids, "attention_mask": mask, "use_cache": False}


def mamba_example() -> Built:
    """Mamba (its own copy of mamba_selective_scan) from 7 tokens with a padding mask."""
    model, _ = tiny_model(
        "MambaConfig", "MambaModel", tokens=7, vocab_size=64, hidden_size=16, state_size=4, num_hidden_layers=1
    )
    return model, _mamba_padded(2, 7)


mamba_selective_scan_onnx = ModuleFunctionPatch(
    RuleMeta(
        id="patch/mamba-selective-scan-onnx",
        why="Mamba-1 ONNX models fixed the sequence axis to the sample length (the loop in mamba_selective_scan "
        "unrolled: patch/mamba-selective-scan-hop is dynamo-only): ORT rejected falcon_mamba's grown input and "
        "failed in a Mul broadcast on zamba's and jamba's, and on mamba's attention_mask (\"Got invalid "
        "dimensions for input: attention_mask\"); with the scan op not detached, torch.onnx's type promotion fails "
        "with \"AttributeError: 'SymInt' object has no attribute 'unsqueeze'\" in scan's fake kernel",
        upstream="torch==2.13.0 _higher_order_ops/scan.py autograd path under fake tensors with symbolic shapes "
        "(scan_fake_tensor_mode stacks saved SymInts), hit by torch.onnx InsertTypePromotion; scan's nested dynamo "
        "cannot fakify a detached view of symbolic-size storage; transformers 5.24 mamba_selective_scan",
        backends=("onnx",),
        models=_VERIFIED,
        examples=(
            Match(
                zamba_example,
                "zamba, per-head views as the scan's inputs, odd length, then a longer input through the same program",
                atol=1e-6,
                rtol=1e-6,
                other_inputs=lambda: {"input_ids": torch.randint(0, 64, (3, 12)), "use_cache": False},
            ),
            *EXAMPLES,
            Match(
                mamba_example,
                "mamba with a left-padded attention_mask, odd length, then 13 tokens and another batch",
                atol=1e-6,
                rtol=1e-6,
                other_inputs=lambda: _mamba_padded(3, 13),
            ),
        ),
    ),
    target=tuple(f"transformers.models.{f}.modeling_{f}.mamba_selective_scan" for f in _VERIFIED),
    replacement=scan_selective_detached,
)
