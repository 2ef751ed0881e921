"""ExecuTorch backend fixes (stage `executorch`), in the order they run on the program before lowering."""

import hfexport.rewrites.executorch_kinds  # noqa: F401 - registers the stage's applier and example checker

RULES: list = []
