"""Model patches scoped to the executorch backend (`backends=("executorch",)`); listed in the package's RULES."""

RULES: list = []
