"""The gain of `onnx/matmul-add-gemm-fusion`: MatMul + Add against one Gemm in ONNX Runtime (default threads).

    python tools/ab_gemm_fusion.py

A model of one product of [m, 576] x [576, 576] plus a bias (m = 1: a decode step's row; m = 128: a prompt),
written both ways; 7 rounds of 200 calls alternated between the two sessions, the median per call.
"""

import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def model(gemm: bool, k: int = 576, n: int = 576) -> bytes:
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((k, n)).astype(np.float32), "w")
    b = numpy_helper.from_array(rng.standard_normal((n,)).astype(np.float32), "b")
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", k])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["m", n])
    nodes = (
        [helper.make_node("Gemm", ["x", "w", "b"], ["y"])]
        if gemm
        else [helper.make_node("MatMul", ["x", "w"], ["t"]), helper.make_node("Add", ["t", "b"], ["y"])]
    )
    g = helper.make_graph(nodes, "g", [x], [y], [w, b])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)]).SerializeToString()


for m in (1, 128):
    x = np.random.default_rng(1).standard_normal((m, 576)).astype(np.float32)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    sess = {g: ort.InferenceSession(model(g), so, providers=["CPUExecutionProvider"]) for g in (False, True)}
    times = {g: [] for g in sess}
    for _ in range(7):
        for g, s in sess.items():
            s.run(None, {"x": x})
            t = time.perf_counter()
            for _ in range(200):
                s.run(None, {"x": x})
            times[g].append((time.perf_counter() - t) / 200 * 1e6)
    a, b = statistics.median(times[False]), statistics.median(times[True])
    close = np.allclose(sess[False].run(None, {"x": x})[0], sess[True].run(None, {"x": x})[0], atol=1e-4)
    print(f"m={m}: MatMul+Add {a:.1f} us, Gemm {b:.1f} us, gain {a / b:.2f}x; outputs equal: {close}")
