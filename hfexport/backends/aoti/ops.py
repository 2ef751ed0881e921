"""How the ops of an AOTInductor package are counted: the FX program it was compiled from (recorded at compile)."""

from __future__ import annotations

from collections import Counter
from typing import Any

from hfexport.backends.descriptor import Ops


def op_counts(package: Any) -> Counter[str]:
    return Counter(package.op_counts)


# No runtime count: the package's kernels are fused C++ loops, not ops.
OPS = Ops(op_counts=op_counts)
