"""ExecuTorch backend fixes (stage `executorch`), in the order they run on the program before lowering."""

from hfexport.rewrites.rule import Rule, load_rules

RULES: list[Rule] = load_rules(
    __name__,
    [
        "executorch/sdpa-output-contiguous-before-view",
        "executorch/unmasked-sdpa-as-custom-sdpa",
        "executorch/grouped-sdpa-without-repeat-kv",
        "executorch/dynamic-trailing-unsqueeze-as-view",
        # A view with one dynamic axis as -1 there: inside XNNPACK's partition (after the unsqueeze rule's views).
        "executorch/one-dynamic-axis-view-inferred",
        # RMSNorm's last-axis mean as XNNPACK's pooling between two such views.
        "executorch/last-axis-mean-as-pooling",
        "executorch/dynamic-conv1d-as-conv2d",
        "executorch/dynamic-empty-as-zeros",
        "executorch/split-as-slices",
        "executorch/max-values-as-amax",
        "executorch/integer-sort-as-topk",
        "executorch/scatter-min-max-as-masked-reduction",
        "executorch/is-all-true-as-any",
        "executorch/bucketize-as-comparison-count",
        "executorch/quant-slice-keeps-qparams",
        "executorch/quant-identity-requantize",
        "executorch/quant-computed-weight-linear-untagged",
        "executorch/quant-right-shift-verifier",
        "executorch/quant-dynamic-chain-per-consumer",
        # A static cache input without to_edge's write-back copies (an edge pass).
        "executorch/cache-input-no-write-back",
        # Same-shape slice/expand/view copies of the edge dialect (the cache's, in a decode step) dropped.
        "executorch/drop-identity-copies",
        # Last: counts the calls the node rules leave in the graph.
        "executorch/sym-size-functions-verifier",
    ],
)
