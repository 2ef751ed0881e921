"""Model patches (stage `patch`), in the order they are installed.

The patches below touch disjoint functions, so their order does not matter yet.
"""

from hfexport.rewrites.rule import Rule
from hfexport.rewrites.rules.patch.cpmant_mask_arange import cpmant_mask_arange
from hfexport.rewrites.rules.patch.deepseek_v4_overlap_windows import deepseek_v4_overlap_windows
from hfexport.rewrites.rules.patch.executorch_jetmoe_rowwise_experts import executorch_jetmoe_rowwise_experts
from hfexport.rewrites.rules.patch.executorch_moe_batched_experts import executorch_moe_batched_experts
from hfexport.rewrites.rules.patch.fake_constant_layouts import fake_constant_layouts
from hfexport.rewrites.rules.patch.gated_delta_chunk_scan_hop import gated_delta_chunk_scan_hop
from hfexport.rewrites.rules.patch.hunyuan_vl_placeholder_check import hunyuan_vl_placeholder_check
from hfexport.rewrites.rules.patch.longt5_pad_blocks import longt5_pad_blocks
from hfexport.rewrites.rules.patch.mamba2_chunk_scan_symbolic import mamba2_chunk_scan_symbolic
from hfexport.rewrites.rules.patch.mamba_selective_scan_hop import mamba_selective_scan_hop
from hfexport.rewrites.rules.patch.mamba_selective_scan_onnx import mamba_selective_scan_onnx
from hfexport.rewrites.rules.patch.minimax_m3_index_blocks import minimax_m3_index_blocks
from hfexport.rewrites.rules.patch.moe_grouped_mm_portable import moe_grouped_mm_portable
from hfexport.rewrites.rules.patch.moonshine_conv_lengths import moonshine_conv_lengths
from hfexport.rewrites.rules.patch.nllb_moe_dense_experts import nllb_moe_dense_experts
from hfexport.rewrites.rules.patch.nllb_moe_router_cast import nllb_moe_router_cast
from hfexport.rewrites.rules.patch.openvino_moe_batched_experts import openvino_moe_batched_experts

RULES: list[Rule] = [
    mamba_selective_scan_hop,
    mamba2_chunk_scan_symbolic,
    gated_delta_chunk_scan_hop,
    moe_grouped_mm_portable,
    cpmant_mask_arange,
    mamba_selective_scan_onnx,
    fake_constant_layouts,
    longt5_pad_blocks,
    nllb_moe_router_cast,
    nllb_moe_dense_experts,
    moonshine_conv_lengths,
    hunyuan_vl_placeholder_check,
    minimax_m3_index_blocks,
    deepseek_v4_overlap_windows,
    # Backend-scoped patches.
    # Independent of patch/moe-grouped-mm-portable: experts run as batched_mm never call grouped_mm.
    executorch_moe_batched_experts,
    executorch_jetmoe_rowwise_experts,
    openvino_moe_batched_experts,
]
