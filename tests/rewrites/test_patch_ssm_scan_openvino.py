"""patch/mamba-selective-scan-openvino: why a `while_loop` and not the `scan` of patch/mamba-selective-scan-hop.

Without any rule the loop over the sequence unrolls and the OpenVINO model fails past the sample length (shown by
tests/rewrites/test_examples.py::test_fix_is_needed, `-m slow`). With the hop rule's `scan` in its place the
conversion fails: openvino 2026.4.1 has no translator for `scan`. This test fails once OpenVINO converts a scan,
which is when the two Dynamo/OpenVINO variants can become one rule.
"""

from __future__ import annotations

import dataclasses

import pytest

from hfexport.rewrites.rules.patch.mamba_selective_scan_hop import scan_selective
from hfexport.rewrites.rules.patch.mamba_selective_scan_openvino import mamba_selective_scan_openvino as rule
from hfexport.testing.harness import check_match


@pytest.mark.slow
def test_the_scan_op_does_not_convert_to_openvino() -> None:
    pytest.importorskip("openvino")
    with_scan = dataclasses.replace(rule, replacement=scan_selective)
    with pytest.raises(Exception, match=r"Conversion is failed for: .*scan"):
        check_match(with_scan, rule.meta.examples[0], "openvino")
