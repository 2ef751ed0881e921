"""Why some examples fail on one backend for a reason outside their rule: an architecture that backend does not
lower yet (issue #17). The examples name these in `known_failure`, a strict expected failure per backend."""

from __future__ import annotations

XNNPACK_RESHAPE = (
    "XNNPACK's serializer refuses a reshape with more than one dynamic dimension ('XNNPACK reshape only supports 1 "
    "dynamic dimension'), and the example's batch and length are both dynamic: an ExecuTorch coverage gap of the "
    "architecture (#17), not of the rule"
)
