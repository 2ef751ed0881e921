"""Model patches scoped to the executorch backend (`backends=("executorch",)`); listed in the package's RULES."""

from hfexport.rewrites.patches import executorch_jetmoe, executorch_moe

RULES: list = [
    # Independent of patch/moe-grouped-mm-portable: experts run as batched_mm never call grouped_mm.
    executorch_moe.executorch_batched_experts,
    executorch_jetmoe.executorch_jetmoe_rowwise_experts,
]
