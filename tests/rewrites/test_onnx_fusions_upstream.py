"""The norm fusions call onnxscript's own ORT fusions: on tiny-llama and tiny-gpt2 they fuse what
`onnxscript.rewriter.ort_fusions.optimize_for_ort` fuses, and ONNX Runtime still matches eager."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch

FUSED = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "SkipLayerNormalization")
NORM_RULES = (
    "onnx/rms-norm-fusion",
    "onnx/rms-norm-core-fusion",
    "onnx/skip-rms-norm-fusion",
    "onnx/skip-layer-norm-fusion",
)


def _fused(model: Any) -> Counter[str]:
    return Counter(node.op_type for node in model.graph.all_nodes() if node.op_type in FUSED)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
@pytest.mark.slow
def test_norm_fusions_fuse_what_onnxscript_fuses(name: str) -> None:
    import onnx
    import onnx_ir as ir
    import onnxruntime as ort
    from onnxscript.rewriter.ort_fusions import optimize_for_ort

    from hfexport import OnnxConfig, OnnxExporter
    from hfexport.naming import onnx_feed
    from hfexport.rewrites.engine import apply_rule, default_registry
    from hfexport.tiny import get_tiny_model

    tiny = get_tiny_model(name)
    model, inputs = tiny.build(), tiny.sample_inputs()
    unfused = OnnxExporter().export(model, inputs, OnnxConfig(fusions=None, dynamic=True)).model
    proto = ir.serde.serialize_model(unfused).SerializeToString()
    ours = ir.serde.deserialize_model(onnx.load_from_string(proto))
    registry = default_registry()
    hits = {rule_id: apply_rule(registry.get(rule_id), ours).hits for rule_id in NORM_RULES}
    upstream, _ = optimize_for_ort(ir.serde.deserialize_model(onnx.load_from_string(proto)))
    assert sum(hits.values()) > 0 and _fused(ours) == _fused(upstream), (hits, _fused(ours), _fused(upstream))

    session = ort.InferenceSession(ir.serde.serialize_model(ours).SerializeToString())
    with torch.no_grad():
        expected = model(**inputs).logits.numpy()
    logits = session.run(None, onnx_feed([i.name for i in session.get_inputs()], inputs))[0]
    assert np.abs(logits - expected).max() < 1e-5
