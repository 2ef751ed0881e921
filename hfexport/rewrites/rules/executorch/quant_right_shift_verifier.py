"""Rule `executorch/quant-right-shift-verifier` (shared code: `_quant_weight_decompression`)."""

from __future__ import annotations

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.executorch import ExecutorchVerifierExceptionRule
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules._nncf_int4 import unpack_example
from hfexport.rewrites.rules.executorch._quant_weight_decompression import RIGHT_SHIFTS, nibbles_example

quant_right_shift_verifier = ExecutorchVerifierExceptionRule(
    RuleMeta(
        id="executorch/quant-right-shift-verifier",
        why="NNCF's int4 weights are unpacked with aten.bitwise_right_shift, which to_edge refuses as not core "
        "ATen although the portable kernels run it (NNCFTorchFXQuantizer int4 on ExecuTorch)",
        upstream="https://github.com/pytorch/executorch/pull/15893 (kernels added, op left out of core ATen: 'use "
        "_core_aten_ops_exception_list'); https://github.com/pytorch/executorch/issues/15673",
        backends=("executorch",),
        models=("nncf-int4",),
        examples=(
            Match(unpack_example, "every byte value >> 4 (NNCF's unpacking), >> 1 and >> 7, exact", atol=0.0, rtol=0.0),
            NoMatch(nibbles_example, "the same nibbles by floor division: no shift"),
        ),
    ),
    targets=RIGHT_SHIFTS,
)
