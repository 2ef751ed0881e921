"""How the ops of an ExecuTorch program are counted: its edge program's FX graph."""

from __future__ import annotations

from collections import Counter
from typing import Any

from hfexport.backends.descriptor import Ops
from hfexport.backends.dynamo.ops import fx_op_counts


def op_counts(manager: Any) -> Counter[str]:
    return fx_op_counts(manager.exported_program())


# No runtime count: ExecuTorch has no optimization rules whose effect an audit would measure yet.
OPS = Ops(op_counts=op_counts)
