"""bf16 and fp16 checkpoints on every backend (issue #21, item 10), on tiny models of the corpus.

Each architecture is built in float32 from its seed, cast to the dtype, exported with `dynamic=True`, and run in the
backend's runtime on the sample and on a longer (grown) input. The reference is eager in the same dtype; the bound is
what the dtype itself costs: twice the distance between eager in the dtype and the float32 function of the same
(rounded) weights, plus two rounding steps of the largest output (a backend sums in another order, and each partial
sum rounds: OpenVINO's batched experts of a bf16 Mixtral are 0.0068 from eager, 4x the rounding of 0.0016). A file
that does not load, or outputs misread (a bf16 output viewed as fp16 bits was off by the size of the logits), fails
by far more.

- Dynamo, ExecuTorch (XNNPACK) and OpenVINO (CPU) keep the dtype: bf16/fp16 weights, outputs in the dtype.
- ONNX keeps fp16. For bf16 it computes in float32 (ONNX Runtime's CPU provider has no bf16 kernels: a bf16 file
  did not load, "MatMul(13) not implemented"): its outputs are float32 and must be the float32 function of the bf16
  weights within 1e-4 (hfexport/exporters/preflight.py, `bfloat16_upcast`).

A few architectures run by default; more with `-m slow`.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch

from hfexport import AutoExportConfig, AutoHfExporter
from hfexport.testing.corpus import CorpusEntry, load_corpus
from tests.test_reliability_invariants import skip_without, untouched

BACKENDS = ("dynamo", "onnx", "openvino", "executorch")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# Default tier: a dense decoder on every backend, a second architecture (learned positions, LayerNorm) where the
# lowering is fast. The slow tier adds MoE, sliding windows and soft-capping, an encoder.
# The default tier: Llama on the backends whose exports take seconds (ExecuTorch's lowering takes a minute).
FAST: dict[str, set[str]] = {"dynamo": {"llama"}, "onnx": {"llama"}, "openvino": {"llama"}, "executorch": set()}
SLOW = {"llama", "gpt2", "opt", "qwen3_moe", "mixtral", "gemma2", "starcoder2", "bert"}
_ENTRIES = {e.model_type: e for e in [*load_corpus(family="causal_lm"), *load_corpus(family="encoder")]}
# One rounding step (machine epsilon) of each dtype.
_EPS = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}


def _params() -> list[Any]:
    params = []
    for backend in BACKENDS:
        for dtype in DTYPES:
            for model_type in sorted(SLOW):
                # ExecuTorch's lowering takes a minute: its default tier is bf16 only (the dtype that needed fixes).
                fast = model_type in FAST[backend] and not (backend == "executorch" and dtype == "float16")
                marks = [] if fast else [pytest.mark.slow]
                params.append(
                    pytest.param(backend, dtype, model_type, id=f"{backend}-{dtype}-{model_type}", marks=marks)
                )
    return params


def _run(backend: str, result: Any, entry: CorpusEntry, feed: dict[str, torch.Tensor], tmp_path: Path) -> torch.Tensor:
    """The compared output of `result` run in the backend's runtime."""
    if backend == "dynamo":
        with torch.no_grad():
            return entry.main_output(result.module()(**feed))
    if backend == "onnx":
        import onnxruntime as ort

        from hfexport.naming import onnx_feed

        session = ort.InferenceSession(result.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]
        return torch.from_numpy(session.run([entry.output], onnx_feed(names, feed))[0])
    if backend == "openvino":
        from hfexport.runtime.openvino import OpenVINORunner

        return OpenVINORunner(result)(**feed)[entry.output]
    from hfexport.runtime.executorch import ExecutorchProgram

    path = tmp_path / "model.pte"
    if not path.exists():
        result.save(str(path))
    return ExecutorchProgram(path).run(feed)[0]


@pytest.mark.parametrize(("backend", "dtype_name", "model_type"), _params())
def test_a_reduced_precision_checkpoint_exports_and_matches_eager_in_its_dtype(
    backend: str, dtype_name: str, model_type: str, tmp_path: Path
) -> None:
    skip_without(backend)
    dtype = DTYPES[dtype_name]
    entry = _ENTRIES[model_type]
    model = entry.build_model().to(dtype)
    reference = copy.deepcopy(model).float()  # the float32 function of the same rounded weights
    inputs = entry.sample_inputs()
    config = AutoExportConfig.from_dict({"export_format": backend, "dynamic": True})
    exporter = AutoHfExporter.from_config(config)
    with untouched(model, inputs):
        result = exporter.export(model, inputs, config=config)
    upcast = backend == "onnx" and dtype == torch.bfloat16
    for what, feed in (("sample", inputs), ("grown", entry.grown_inputs())):
        with torch.no_grad():
            expected = entry.main_output(model(**feed)).float()
            exact = entry.main_output(reference(**feed))
        actual = _run(backend, result, entry, feed, tmp_path)
        assert actual.shape == expected.shape, what
        assert actual.dtype == (torch.float32 if upcast else dtype), f"{what}: output dtype {actual.dtype}"
        rounding = (expected - exact).abs().max().item()
        diff = (actual.float() - expected).abs().max().item()
        bound = 2 * rounding + 2 * _EPS[dtype] * expected.abs().max().item()
        print(f"{backend} {dtype_name} {model_type} {what}: max abs diff {diff:.3g} (dtype rounding {rounding:.3g})")
        assert diff <= bound, f"{model_type} {what}: max abs diff {diff:.3g} > {bound:.3g} (rounding {rounding:.3g})"
        if upcast:
            exact_diff = (actual - exact).abs().max().item()
            assert exact_diff <= 1e-4 * max(1.0, exact.abs().max().item()), f"{what}: {exact_diff:.3g} from float32"
    if upcast:  # said in the report
        assert any("no bfloat16 kernels" in w for w in exporter.report.warnings), exporter.report.warnings


def test_onnx_bfloat16_inputs_and_cache_are_exported_as_float32_and_left_as_they_were() -> None:
    """A bf16 `inputs_embeds` and a bf16 DynamicCache: the trace runs on float32 copies (the caller's keep their
    dtype and objects), the ONNX inputs are float32, and the outputs are the float32 function of the bf16 values."""
    skip_without("onnx")
    import onnxruntime as ort

    from hfexport import OnnxExporter
    from hfexport.core.cache_pytree import flatten_cache, unflatten_cache
    from hfexport.naming import onnx_feed
    from tests.test_reliability_invariants import micro_llama, sample_inputs

    model = micro_llama().to(torch.bfloat16)
    reference = copy.deepcopy(model).float()
    ids = sample_inputs()["input_ids"]
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
    embeds = model.get_input_embeddings()(ids[:, -1:]).detach()
    mask = torch.ones(ids.shape[0], ids.shape[1] + 1, dtype=torch.int64)
    inputs = {"inputs_embeds": embeds, "attention_mask": mask, "past_key_values": cache}

    def as_float32(value: Any) -> Any:
        leaves, skeleton = flatten_cache(value)
        return unflatten_cache([leaf.float() for leaf in leaves], skeleton)

    with torch.no_grad():
        exact = reference(**{**inputs, "inputs_embeds": embeds.float(), "past_key_values": as_float32(cache)}).logits
    with untouched(model, inputs):
        program = OnnxExporter().export(model, inputs)
    assert all(leaf.dtype == torch.bfloat16 for leaf in flatten_cache(cache)[0]) and embeds.dtype == torch.bfloat16
    session = ort.InferenceSession(program.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
    assert {i.type for i in session.get_inputs() if i.name != "attention_mask"} == {"tensor(float)"}
    feed = {**inputs, "inputs_embeds": embeds.float(), "past_key_values": as_float32(cache)}
    actual = torch.from_numpy(session.run(None, onnx_feed([i.name for i in session.get_inputs()], feed))[0])
    assert (actual - exact).abs().max().item() <= 1e-4 * max(1.0, exact.abs().max().item())


# Slow: an export_for_generation per backend (the default tier covers the bf16 cache in test_onnx_bfloat16_inputs_*).
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["onnx", "openvino"])
def test_generation_from_a_bfloat16_export_gives_generate_s_tokens(backend: str) -> None:
    """export_for_generation of a bf16 model and hfexport's generation loop: greedy tokens equal `model.generate`
    (ONNX: the cache fed back is float32; OpenVINO: bf16, handed over through numpy as 16-bit arrays)."""
    skip_without(backend)
    from hfexport.runtime.generation import generate
    from tests.test_reliability_invariants import micro_llama, sample_inputs

    model, inputs = micro_llama().to(torch.bfloat16), sample_inputs()
    with torch.no_grad():
        expected = model.generate(**inputs, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    config = AutoExportConfig.from_dict({"export_format": backend, "dynamic": True})
    components = AutoHfExporter.from_config(config).export_for_generation(
        model, {**inputs, "max_new_tokens": 5}, config
    )
    got = generate(components, inputs["input_ids"], inputs["attention_mask"], max_new_tokens=5, min_new_tokens=5)
    assert torch.equal(got, expected), (got, expected)
