"""`generate(..., runtime_options=RuntimeOptions(...))` opens the runtimes with the caller's ONNX Runtime session
options and OpenVINO compile properties (tools/profile_generate.py profiles through them): the options must
reach the runtime (ORT writes its profile file; OpenVINO's infer request has per-node counters) and leave the
tokens as they were. `generate(..., torch_threads=...)` sets torch's intra-op threads while the loop runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import GenerationConfig

from hfexport import OnnxConfig, OnnxExporter, OpenVINOConfig, OpenVINOExporter
from hfexport.runtime import RuntimeOptions
from hfexport.runtime.generation import generate
from hfexport.tiny import get_tiny_model

NEW = 4


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    return get_tiny_model("tiny-llama").build()


def _prompt() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    return ids, mask


def _export(exporter: object, config: object, llama: torch.nn.Module) -> object:
    sample = {"input_ids": torch.randint(3, 128, (2, 5), generator=torch.Generator().manual_seed(0))}
    static = GenerationConfig(cache_implementation="static", max_cache_len=16)
    return exporter.export_for_generation(llama, sample, config, generation_config=static, multi_token_decode=True)


def test_onnx_session_options_reach_onnx_runtime(llama: torch.nn.Module, tmp_path: Path) -> None:
    import onnxruntime as ort

    components = _export(OnnxExporter(), OnnxConfig(dynamic=True), llama)
    ids, mask = _prompt()
    plain = generate(components, ids, mask, max_new_tokens=NEW, min_new_tokens=NEW)
    options = ort.SessionOptions()
    options.enable_profiling = True
    options.profile_file_prefix = str(tmp_path / "ortprof")
    profiled = generate(
        components, ids, mask, max_new_tokens=NEW, min_new_tokens=NEW, runtime_options=RuntimeOptions(options)
    )
    assert torch.equal(profiled, plain)
    from hfexport.runtime.generation_session import generation_driver

    driver = generation_driver(components)
    assert driver.options.onnx_session_options is options
    written = Path(driver.sessions["decode"].end_profiling())
    assert written.parent == tmp_path and written.name.startswith("ortprof")
    events = json.loads(written.read_text())
    # One model run per call: the prompt, then NEW - 1 decode steps; and per-node kernel times.
    assert sum(e.get("name") == "model_run" for e in events) == NEW
    assert any(e.get("cat") == "Node" and e["name"].endswith("_kernel_time") for e in events)
    # A later call without options keeps the profiled driver rather than opening the sessions again.
    generate(components, ids, mask, max_new_tokens=1)
    assert generation_driver(components) is driver


@pytest.mark.slow
def test_openvino_properties_reach_the_compiled_model(llama: torch.nn.Module) -> None:
    pytest.importorskip("openvino")
    components = _export(OpenVINOExporter(), OpenVINOConfig(dynamic=True), llama)
    ids, mask = _prompt()
    plain = generate(components, ids, mask, max_new_tokens=NEW, min_new_tokens=NEW)
    counted: list[int] = []

    def count(driver: object) -> None:
        counted.append(len(driver.requests["decode"].get_profiling_info()))

    options = RuntimeOptions(openvino_properties={"PERF_COUNT": "YES"})
    got = generate(
        components, ids, mask, max_new_tokens=NEW, min_new_tokens=NEW, on_step=count, runtime_options=options
    )
    assert torch.equal(got, plain)
    assert len(counted) == NEW - 1 and all(n > 0 for n in counted)
    from hfexport.runtime.generation_session import generation_driver

    compiled = generation_driver(components).runners["decode"].compiled
    assert compiled.get_property("PERF_COUNT") in (True, "YES")
    # The caller's properties come over hfexport's f32 hint, which stays.
    assert "f32" in str(compiled.get_property("INFERENCE_PRECISION_HINT")) or "float32" in str(
        compiled.get_property("INFERENCE_PRECISION_HINT")
    )


@pytest.mark.slow
def test_torch_threads_are_one_while_a_runtime_with_its_own_threads_generates(llama: torch.nn.Module) -> None:
    """`generate` drives ONNX Runtime with torch's intra-op threads at `torch_threads` (1 by default; None keeps
    them), restores them after, also when the loop raises, and leaves them alone for Dynamo (torch is its runtime)."""
    from hfexport import DynamoConfig, DynamoExporter

    onnx = _export(OnnxExporter(), OnnxConfig(dynamic=True), llama)
    dynamo = _export(DynamoExporter(), DynamoConfig(dynamic=True), llama)
    ids, mask = _prompt()
    seen: list[int] = []

    def record(driver: object) -> None:
        seen.append(torch.get_num_threads())

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        one = generate(onnx, ids, mask, max_new_tokens=NEW, min_new_tokens=NEW, on_step=record)
        assert seen and set(seen) == {1} and torch.get_num_threads() == 2
        seen.clear()
        kept = generate(onnx, ids, mask, max_new_tokens=NEW, min_new_tokens=NEW, on_step=record, torch_threads=None)
        assert set(seen) == {2} and torch.equal(one, kept)
        seen.clear()
        generate(dynamo, ids, mask, max_new_tokens=NEW, min_new_tokens=NEW, on_step=record)
        assert set(seen) == {2}

        def fail(driver: object) -> None:
            raise RuntimeError("stop")

        with pytest.raises(RuntimeError, match="stop"):
            generate(onnx, ids, mask, max_new_tokens=NEW, min_new_tokens=NEW, on_step=fail)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
