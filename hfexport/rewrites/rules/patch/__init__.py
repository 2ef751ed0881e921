"""Model patches (stage `patch`), in the order they are installed.

The patches below touch disjoint functions, so their order does not matter yet.
"""

from hfexport.rewrites.rule import Rule, load_rules

RULES: list[Rule] = load_rules(
    __name__,
    [
        "patch/mamba-selective-scan-hop",
        "patch/mamba2-chunk-scan-symbolic",
        "patch/gated-delta-chunk-scan-hop",
        "patch/kimi-delta-chunk-scan-hop",
        "patch/cpmant-mask-arange",
        "patch/fake-constant-layouts",
        "patch/mrope-index-tensor",
        "patch/vision-window-index-eager",
        "patch/square-patch-grid-static",
        "patch/longt5-pad-blocks",
        "patch/bigbird-block-sparse-dense",
        "patch/bigbird-pad-blocks",
        "patch/nllb-moe-router-cast",
        "patch/nllb-moe-routed-experts",
        "patch/moonshine-conv-lengths",
        "patch/hunyuan-vl-placeholder-check",
        "patch/hunyuan-vl-rope-index-tensor",
        "patch/minimax-m3-index-blocks",
        "patch/deepseek-v4-overlap-windows",
        "patch/deepseek-v4-window-buffer",
        "patch/sliding-window-cache-symbolic",
        "patch/sliding-window-mask-sizes-symbolic",
        "patch/sdpa-causal-skip-traced",
        "patch/static-sliding-window-full-length",
        "patch/identity-experts-routed-loop",
        "patch/experts-hit-loop-every-expert",
        "patch/qsa-indexer-vectorized",
        "patch/eos-pooling-gather",
        "patch/reformer-axial-positions-gather",
        "patch/rwkv-linear-attention-scan",
        "patch/xlstm-mlstm-scan",
        "patch/rglru-recurrence-scan",
        "patch/rglru-state-in-cache",
        "patch/prophetnet-decode-positions-symbolic",
        "patch/longformer-attention-dense",
        "patch/longformer-pad-always",
        "patch/max-pool1d-windows-symbolic",
        "patch/squeezed-frames-pad-always",
        "patch/tensor-len-symbolic",
        # Backend-scoped patches.
        "patch/moe-batched-experts",
        "patch/jetmoe-rowwise-experts",
    ],
)
