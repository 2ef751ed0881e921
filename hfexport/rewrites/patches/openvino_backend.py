"""Model patches scoped to the openvino backend (`backends=("openvino",)`); listed in the package's RULES."""

from hfexport.rewrites.patches import openvino_moe

RULES: list = [
    openvino_moe.openvino_batched_experts,
]
