"""AOTInductor (`--format aoti`): the Dynamo program compiled to C++ kernels in a `.pt2` package.

A compile takes tens of seconds on the 2-core CI machine, so the default tier compiles twice: one single-graph export
(export, save with checksums, load only with trust, run against eager), and one generation with a static cache and
a multi-token decode graph (the prefill shares it: one compile), whose tokens equal `model.generate`'s, whose cache is
written in place, and which loads back as an `ExportedModelForCausalLM`. The rule examples on AOTInductor, the other
generation layouts and the 40-architecture coverage run in the slow tier and as a tool (docs/aoti.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import GenerationConfig

import hfexport
from hfexport import AOTInductorConfig, AOTInductorExporter, AutoExportConfig, AutoHfExporter, ExportFormat
from hfexport.artifacts import ArtifactError, UntrustedArtifactError
from hfexport.core.errors import ConfigError
from hfexport.formats import format_of
from hfexport.runtime import generate
from hfexport.tiny import get_tiny_model

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    return get_tiny_model("tiny-llama").build().eval()


@pytest.fixture(scope="module")
def single(llama, tmp_path_factory) -> tuple:
    """One dynamic export of the tiny llama's forward, and the artifact it is saved as."""
    inputs = get_tiny_model("tiny-llama").sample_inputs(batch=2, length=6)
    exporter = AOTInductorExporter()
    package = exporter.export(llama, inputs, AOTInductorConfig(dynamic=True))
    folder = tmp_path_factory.mktemp("aoti") / "single"
    hfexport.save(package, folder, config=AOTInductorConfig(dynamic=True), report=exporter.report)
    return package, exporter.report, folder


def test_export_runs_like_eager_and_saves_with_checksums(single, llama) -> None:
    package, report, folder = single
    assert format_of(package) == ExportFormat.AOTI == "aoti" and report.export_format == "aoti"
    # The Dynamo rules ran (the same capture), and the compile was a stage of its own.
    assert "compile" in report.stage_seconds and "fx" in report.stage_seconds
    other = get_tiny_model("tiny-llama").sample_inputs(seed=3, batch=3, length=11)  # dynamic batch and length
    with torch.no_grad():
        want = llama(**other).logits
    torch.testing.assert_close(package(**other)["logits"], want, atol=1e-4, rtol=1e-4)
    # Views with other strides (the generation loop's expanded position ids, sliced masks) are read as what they hold.
    strided = {
        "input_ids": other["input_ids"].t().contiguous().t(),
        "attention_mask": torch.ones(1, 11, dtype=torch.long).expand(3, 11),
    }
    assert not strided["input_ids"].is_contiguous()
    torch.testing.assert_close(package(**strided)["logits"], want, atol=1e-4, rtol=1e-4)

    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["format"] == "aoti" and "model.pt2" in manifest["files"]
    with pytest.raises(UntrustedArtifactError, match="compiled native code"):
        hfexport.load(folder)
    loaded = hfexport.load(folder, trust=True)
    torch.testing.assert_close(loaded.run(other)["logits"], want, atol=1e-4, rtol=1e-4)


class _KeepsLastHidden(torch.nn.Module):
    """Returns None for the hidden states it does not keep, as CLIP's tower does under `output_hidden_states=-1`."""

    def forward(self, x: torch.Tensor) -> dict:
        first = x * 2
        return {"last_hidden_state": first + 1, "hidden_states": (None, first + 1)}


@pytest.mark.slow
def test_a_constant_output_is_left_out_of_the_results_also_after_a_reload(tmp_path) -> None:
    module, x = _KeepsLastHidden(), torch.randn(2, 3)
    package = AOTInductorExporter().export(module, {"x": x}, AOTInductorConfig(dynamic=True))
    assert package.output_names == ["last_hidden_state", "hidden_states.1"]
    want = {"last_hidden_state": x * 2 + 1, "hidden_states.1": x * 2 + 1}
    got = package(x=x)
    assert list(got) == list(want) and all(torch.equal(got[k], v) for k, v in want.items())
    hfexport.save(package, tmp_path)  # reloaded, the names come from the package's own metadata
    loaded = hfexport.load(tmp_path, trust=True).run({"x": x})
    assert list(loaded) == list(want) and all(torch.equal(loaded[k], v) for k, v in want.items())


def test_a_changed_package_is_refused(single, tmp_path) -> None:
    import shutil

    _, _, folder = single
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    data = bytearray((copy / "model.pt2").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (copy / "model.pt2").write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match=r"sha256|checksum"):
        hfexport.load(copy, trust=True)


def test_the_config_and_the_auto_classes() -> None:
    config = AutoExportConfig.from_dict({"export_format": "aoti", "dynamic": True, "inductor_configs": {"a.b": 1}})
    assert type(config) is AOTInductorConfig and type(AutoHfExporter.from_config(config)) is AOTInductorExporter
    assert AOTInductorConfig.from_json(config.to_json()) == config
    with pytest.raises(ConfigError, match=r"\.pt2"):
        AOTInductorConfig(output_path="model.so")
    with pytest.raises(ConfigError, match=r"takes an? AOTInductorConfig"):
        AOTInductorExporter().export(torch.nn.Linear(2, 2), {"input": torch.ones(1, 2)}, hfexport.DynamoConfig())


@pytest.mark.slow
def test_generation_with_a_static_cache_equals_generate_and_writes_the_cache_in_place(llama, tmp_path) -> None:
    prompt = torch.tensor([[5, 17, 99, 42, 8, 3, 77], [9, 10, 64, 20, 33, 21, 90]])
    static = GenerationConfig(cache_implementation="static", max_cache_len=prompt.shape[1] + NEW_TOKENS + 2)
    exporter = AOTInductorExporter()
    components = exporter.export_for_generation(
        llama, {"input_ids": prompt}, AOTInductorConfig(dynamic=True), generation_config=static, multi_token_decode=True
    )
    assert components["prefill"] is components["decode"]  # one graph, compiled once
    with torch.no_grad():
        want = llama.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)

    pointers: list[list[int]] = []

    def record(driver: object) -> None:
        pointers.append([t.data_ptr() for t in driver.cache.values()])

    got = generate(components, prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, on_step=record)
    assert torch.equal(got, want)
    # The cache tensors the first step fed are those every step wrote: the package updates them in place.
    assert len(pointers) > NEW_TOKENS // 2 and all(p == pointers[0] for p in pointers)

    folder = tmp_path / "generation"
    hfexport.save(components, folder, model=llama)
    model = hfexport.ExportedModelForCausalLM.from_pretrained(folder, trust=True)
    assert model.export_format == "aoti"
    again = model.generate(prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(again, want)


def test_a_missing_compiler_is_refused_before_tracing() -> None:
    # CXX names the compiler torch's builder uses (read when torch._inductor is imported: a fresh process).
    code = (
        "import torch, hfexport\n"
        "exporter = hfexport.AOTInductorExporter()\n"
        "try:\n"
        "    exporter.export(torch.nn.Linear(2, 2), {'input': torch.ones(2, 2)}, hfexport.AOTInductorConfig())\n"
        "except hfexport.ConfigError as exc:\n"
        "    print('refused:', exc, exporter.report)\n"
    )
    env = {**os.environ, "CXX": "/nonexistent/g++"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert "refused: AOTInductor compiles C++" in done.stdout, done.stdout + done.stderr
    assert done.stdout.rstrip().endswith("None")  # refused before the pipeline started: no report
