"""Model patches (stage `patch`), in the order they are installed.

The patches below touch disjoint functions, so their order does not matter yet.
"""

from hfexport.rewrites.patches import cpmant, moe, ssm_scan

RULES: list = [
    ssm_scan.mamba_selective_scan,
    moe.portable_grouped_mm,
    cpmant.cpmant_mask_arange,
]
