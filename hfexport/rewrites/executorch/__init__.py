"""ExecuTorch backend fixes (stage `executorch`), in the order they run on the program before lowering."""

RULES: list = []
