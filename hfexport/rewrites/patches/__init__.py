"""Model patches (stage `patch`), in the order they are installed.

The patches below touch disjoint functions, so their order does not matter yet.
"""

from hfexport.rewrites.patches import (
    cpmant,
    deepseek_v4,
    executorch_backend,
    fake_constants,
    gated_delta,
    hunyuan_vl,
    longt5,
    mamba2_chunk,
    minimax_m3,
    moe,
    moonshine,
    nllb_moe,
    onnx_ssm_scan,
    openvino_backend,
    ssm_scan,
)

RULES: list = [
    ssm_scan.mamba_selective_scan,
    mamba2_chunk.mamba2_symbolic_chunks,
    gated_delta.gated_delta_chunk_scan,
    moe.portable_grouped_mm,
    cpmant.cpmant_mask_arange,
    onnx_ssm_scan.mamba_selective_scan_onnx,
    fake_constants.fake_constant_layouts,
    longt5.longt5_pad_blocks,
    nllb_moe.nllb_moe_router_cast,
    nllb_moe.nllb_moe_dense_experts,
    moonshine.moonshine_conv_lengths,
    hunyuan_vl.hunyuan_vl_placeholder_check,
    minimax_m3.minimax_m3_index_blocks,
    deepseek_v4.deepseek_v4_overlap_windows,
    # Backend-scoped patches, each list owned by its backend's module.
    *executorch_backend.RULES,
    *openvino_backend.RULES,
]
