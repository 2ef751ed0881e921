"""hfexport.save / hfexport.load: every backend round-trips (single and multi-component) and runs like eager;
saving never leaves half an artifact, and never replaces a folder it was not told to.

Exports are made once per (backend, model) and shared with tests/test_reliability_artifacts.py
(`exported(...)`, cached for the pytest process).
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

import hfexport
from hfexport.artifacts import (
    MANIFEST,
    ArtifactExistsError,
    LoadedExport,
    UntrustedArtifactError,
    load,
    read_manifest,
    save,
)
from hfexport.tiny import TINY_MODELS

BACKENDS = ["dynamo", "onnx", "executorch", "openvino"]
# Relative to max|eager|: ONNX Runtime's fused kernels reorder float sums.
RTOL = {"dynamo": 1e-5, "onnx": 1e-4, "executorch": 1e-5, "openvino": 1e-5}
_PACKAGE = {"onnx": "onnxruntime", "executorch": "executorch", "openvino": "openvino"}


def _skip_without(backend: str) -> None:
    if backend in _PACKAGE:
        pytest.importorskip(_PACKAGE[backend])


@functools.cache
def tiny(name: str) -> tuple[Any, dict[str, torch.Tensor]]:
    model = TINY_MODELS[name]
    return model.build(), model.sample_inputs()


@functools.cache
def exported(backend: str, name: str = "tiny-llama") -> tuple[Any, Any, Any]:
    """(native program, config, report) of one tiny model; OpenVINO keeps f32 weights for tight parity."""
    from hfexport import AutoExportConfig, AutoHfExporter

    _skip_without(backend)
    fields: dict[str, Any] = {"export_format": backend, "dynamic": True}
    if backend == "openvino":
        fields["compress_to_fp16"] = False
    config = AutoExportConfig.from_dict(fields)
    exporter = AutoHfExporter.from_config(config)
    model, inputs = tiny(name)
    program = exporter.export(model, inputs, config=config)
    return program, config, exporter.report


def assert_matches_eager(outputs: dict[str, torch.Tensor], name: str, inputs: dict[str, Any], backend: str) -> None:
    model, _ = tiny(name)
    with torch.no_grad():
        expected = model(**inputs).logits
    got = outputs["logits"]
    assert got.shape == expected.shape
    bound = RTOL[backend] * expected.abs().max().item() + 1e-6
    assert (got - expected).abs().max().item() <= bound


def other_shape() -> dict[str, torch.Tensor]:
    """Inputs of another batch and length than the sample: the loaded graph must still be dynamic."""
    ids = torch.randint(3, 128, (3, 5), generator=torch.Generator().manual_seed(7))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


# ExecuTorch's lowering takes about half a minute: its save, load and run are the default tier's in the built-in
# models' `--generation --validate` cell (tests/test_cli_matrix.py), its single export here in the slow tier.
@pytest.mark.parametrize(
    "backend", [pytest.param(b, marks=[pytest.mark.slow] if b == "executorch" else []) for b in BACKENDS]
)
def test_single_export_round_trips_and_runs_like_eager(backend: str, tmp_path: Path) -> None:
    program, config, report = exported(backend)
    out = save(program, tmp_path / "artifact", config=config, report=report, model="tiny-llama")
    manifest = read_manifest(out)
    assert manifest["format"] == backend and list(manifest["components"]) == ["model"]
    assert manifest["config"]["export_format"] == backend and manifest["report"]["model_class"] == "LlamaForCausalLM"
    assert manifest["inputs"] == ["input_ids", "attention_mask"] and manifest["outputs"][0] == "logits"
    assert set(manifest["checksums"]) == set(manifest["files"]) and "report.json" in manifest["files"]
    assert not [p for p in tmp_path.iterdir() if p.name != "artifact"], "no temporary folder is left behind"

    loaded = hfexport.load(out, trust=backend == "dynamo")
    assert isinstance(loaded, LoadedExport) and loaded.export_format == backend
    _, inputs = tiny("tiny-llama")
    outputs = loaded.run(inputs)
    assert list(outputs)[: len(manifest["outputs"])] == [n.removeprefix("output.") for n in manifest["outputs"]]
    assert_matches_eager(outputs, "tiny-llama", inputs, backend)
    grown = other_shape()
    assert_matches_eager(loaded.components["model"](**grown), "tiny-llama", grown, backend)


# ExecuTorch lowering is the slowest (to_edge + XNNPACK): its second model runs in the slow tier only.
@pytest.mark.parametrize(
    "backend", [b if b != "executorch" else pytest.param(b, marks=pytest.mark.slow) for b in BACKENDS]
)
@pytest.mark.slow
def test_dict_of_two_components_saves_one_folder_each_and_each_runs_like_its_model(
    backend: str, tmp_path: Path
) -> None:
    llama, config, llama_report = exported(backend, "tiny-llama")
    gpt2, _, gpt2_report = exported(backend, "tiny-gpt2")
    out = save(
        {"llama": llama, "gpt2": gpt2},
        tmp_path / "two",
        config=config,
        report={"llama": llama_report, "gpt2": gpt2_report},
    )
    manifest = json.loads((out / MANIFEST).read_text())
    assert set(manifest["components"]) == {"llama", "gpt2"} and "inputs" not in manifest
    for name, comp in manifest["components"].items():
        assert comp["main"].startswith(f"{name}/") and all(f.startswith(f"{name}/") for f in comp["files"])
        assert comp["report"]["model_class"] == ("LlamaForCausalLM" if name == "llama" else "GPT2LMHeadModel")
    assert {p.name for p in out.iterdir()} == {"llama", "gpt2", MANIFEST}

    loaded = load(out, trust=backend == "dynamo")
    for component, model_name in (("llama", "tiny-llama"), ("gpt2", "tiny-gpt2")):
        _, inputs = tiny(model_name)
        # A mix-up of the two components' files would fail here: the models have different weights.
        assert_matches_eager(loaded.run(inputs, component), model_name, inputs, backend)
    with pytest.raises(ValueError, match="name one"):
        loaded.run(tiny("tiny-llama")[1])
    with pytest.raises(KeyError, match="no component 'decode'"):
        loaded["decode"]


def test_export_for_generation_round_trips_with_its_generation_layout(tmp_path: Path) -> None:
    from hfexport import DynamoConfig, DynamoExporter

    model, inputs = tiny("tiny-llama")
    exporter = DynamoExporter()
    components = exporter.export_for_generation(model, inputs, DynamoConfig(dynamic=True))
    assert set(components) == {"prefill", "decode"}
    out = save(components, tmp_path / "gen", config=DynamoConfig(dynamic=True), report=exporter.reports)
    manifest = read_manifest(out)
    assert manifest["generation"] == json.loads(json.dumps(components.spec.to_dict()))
    assert manifest["components"]["decode"]["report"]["component"] == "decode"

    loaded = load(out, trust=True)
    assert loaded.generation == components.spec  # cache layout and constants rebuilt from checked plain data
    for name in ("prefill", "decode"):
        sample = components.samples[name]
        with torch.no_grad():
            expected = components[name].module()(**sample)[0]
        assert torch.equal(loaded.run(sample, name)["logits"], expected), name


def test_pt2_loads_only_with_trust_and_nothing_is_opened_before(tmp_path: Path) -> None:
    program, config, report = exported("dynamo")
    out = save(program, tmp_path / "pt2", config=config, report=report)
    opened: list[str] = []
    with _watch_opens(opened), pytest.raises(UntrustedArtifactError, match="trust=True"):
        load(out)
    assert [p for p in opened if p.endswith("model.pt2")] == []
    assert hfexport.load(out, trust=True).components["model"].runtime is not None


def test_save_refuses_an_existing_folder_without_overwrite_and_leaves_it_intact(tmp_path: Path) -> None:
    program, config, report = exported("dynamo")
    out = save(program, tmp_path / "a", config=config, report=report)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(ArtifactExistsError, match="overwrite=True"):
        save(program, out, config=config)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["a"], "a refused save writes nothing beside the folder either"

    # overwrite replaces the artifact as a whole (the report.json of the first save is gone)
    save(program, out, overwrite=True, config=config)
    assert "report.json" not in {p.name for p in out.iterdir()}
    assert load(out, trust=True).components["model"].report is None

    # ... but never a folder that is not an artifact, and an empty folder is simply used
    other = tmp_path / "photos"
    other.mkdir()
    (other / "cat.jpg").write_bytes(b"meow")
    with pytest.raises(ArtifactExistsError, match="not an hfexport artifact"):
        save(program, other, overwrite=True)
    assert [p.name for p in other.iterdir()] == ["cat.jpg"]
    (tmp_path / "empty").mkdir()
    save(program, tmp_path / "empty")
    assert (tmp_path / "empty" / MANIFEST).is_file()


def _not_ours(tmp_path: Path, kind: str) -> Path:
    """A folder that has a `manifest.json` but is not (provably) an hfexport artifact."""
    folder = tmp_path / kind
    if kind == "browser-extension":
        (folder / "scripts").mkdir(parents=True)
        (folder / "manifest.json").write_text(json.dumps({"manifest_version": 3, "name": "ext", "version": "1"}))
        (folder / "scripts" / "content.js").write_text("console.log('hi')")
    elif kind == "manifest-not-json":
        folder.mkdir()
        (folder / "manifest.json").write_text("not json at all")
        (folder / "notes.txt").write_text("keep me")
    else:  # an hfexport artifact with a file its manifest does not list
        program, config, _ = exported("dynamo")
        save(program, folder, config=config)
        (folder / kind).mkdir()
        (folder / kind / "mine.txt").write_text("keep me")
    return folder


@pytest.mark.parametrize("kind", ["browser-extension", "manifest-not-json", "unlisted-file"])
def test_overwrite_refuses_a_folder_that_is_not_provably_an_artifact_and_leaves_it_intact(
    tmp_path: Path, kind: str
) -> None:
    program, config, _ = exported("dynamo")
    folder = _not_ours(tmp_path, kind)
    before = {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    match = "not listed" if kind == "unlisted-file" else "not an hfexport artifact"
    with pytest.raises(ArtifactExistsError, match=match):
        save(program, folder, overwrite=True, config=config)
    assert {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before
    assert [p.name for p in tmp_path.iterdir()] == [kind], "nothing is left beside it"


def test_overwrite_without_an_atomic_exchange_falls_back_to_two_renames(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Filesystems without renameat2(RENAME_EXCHANGE) (and non-Linux systems) take the two-rename path.
    import hfexport.core.files as files

    program, config, report = exported("dynamo")
    out = save(program, tmp_path / "a", config=config, report=report, metadata={"n": 1})
    calls: list[tuple[Path, Path]] = []
    monkeypatch.setattr(files, "exchange", lambda a, b: calls.append((a, b)) or False)
    save(program, out, overwrite=True, config=config, metadata={"n": 2})
    assert calls and read_manifest(out)["metadata"] == {"n": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["a"], "the previous artifact is removed, nothing is left over"
    assert load(out, trust=True).components["model"].runtime is not None


def test_save_refuses_objects_no_exporter_returns_and_bad_component_names(tmp_path: Path) -> None:
    program, _, _ = exported("dynamo")
    with pytest.raises(TypeError, match=r"cannot save a torch\.nn\.modules\.linear\.Linear"):
        save(torch.nn.Linear(2, 2), tmp_path / "x")
    with pytest.raises(ValueError, match="plain folder name"):
        save({"../up": program}, tmp_path / "y")
    with pytest.raises(ValueError, match="empty"):
        save({}, tmp_path / "z")
    assert list(tmp_path.iterdir()) == []


_KILL_CHILD = r"""
import sys, time
from pathlib import Path
from hfexport.artifacts import load, save
source, destination = sys.argv[1], Path(sys.argv[2])
program = load(source, trust=True).components["model"].open()
print("ready", flush=True)
# Many components make one save long enough to be killed between two of them.
save({f"c{i}": program for i in range(40)}, destination, overwrite=True)
print("saved", flush=True)
"""


def _kill_mid_save(source: Path, destination: Path) -> None:
    """Run a save in a child and SIGKILL it once the temporary folder holds a written component."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    child = subprocess.Popen(
        [sys.executable, "-c", _KILL_CHILD, str(source), str(destination)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            temporaries = list(destination.parent.glob(f".{destination.name}.hfexport-tmp-*/c1/model.pt2"))
            if temporaries:
                break
            assert child.poll() is None, "the save finished before it could be killed"
            time.sleep(0.01)
        else:
            raise AssertionError("the save never started writing")
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert child.returncode == -signal.SIGKILL


@pytest.mark.parametrize("previous", [False, True], ids=["fresh", "over-previous"])
def test_a_save_killed_midway_leaves_no_destination_or_the_previous_artifact(previous: bool, tmp_path: Path) -> None:
    program, config, report = exported("dynamo")
    source = save(program, tmp_path / "source", config=config, report=report)
    destination = tmp_path / "dest"
    if previous:
        save(program, destination, config=config, report=report, model="previous")
        before = read_manifest(destination)
    _kill_mid_save(source, destination)
    leftovers = list(tmp_path.glob(".dest.hfexport-tmp-*"))
    assert leftovers, "the kill landed mid-save (its temporary folder is still there)"
    if previous:
        # The previous artifact, whole: same manifest, every checksum verified, and it runs.
        assert read_manifest(destination) == before
        loaded = load(destination, trust=True)
        _, inputs = tiny("tiny-llama")
        assert_matches_eager(loaded.run(inputs), "tiny-llama", inputs, "dynamo")
    else:
        assert not destination.exists()
    # The next save into the same place clears what the killed one left.
    save(program, destination, overwrite=True)
    assert not list(tmp_path.glob(".dest.hfexport-tmp-*")) and load(destination, trust=True)


class _watch_opens:
    """Record the paths opened (Python-level `open` audit events) inside the block."""

    _active: ClassVar[list[list[str]]] = []
    _installed: ClassVar[bool] = False

    def __init__(self, sink: list[str]) -> None:
        self.sink = sink
        if not _watch_opens._installed:
            sys.addaudithook(_watch_opens._hook)
            _watch_opens._installed = True

    @staticmethod
    def _hook(event: str, args: tuple[Any, ...]) -> None:
        if _watch_opens._active and event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            _watch_opens._active[-1].append(os.fsdecode(args[0]))

    def __enter__(self) -> list[str]:
        _watch_opens._active.append(self.sink)
        return self.sink

    def __exit__(self, *exc: Any) -> None:
        _watch_opens._active.pop()


def test_every_format_has_one_artifact_entry_and_one_runtime_backend() -> None:
    # Per-format behaviour is looked up in the format's descriptor: each covers exactly the formats of hfexport.formats.
    from hfexport.artifacts import ARTIFACT_FORMATS
    from hfexport.backends import names
    from hfexport.formats import FORMATS
    from hfexport.runtime.drivers import backend

    assert list(ARTIFACT_FORMATS) == list(FORMATS) == list(names())
    assert all(ARTIFACT_FORMATS[name].name == backend(name).name == name for name in FORMATS)


def test_replacing_an_artifact_removes_only_the_files_its_manifest_lists(tmp_path: Path) -> None:
    # The replaced folder is checked before the swap; a file that appears in it after the check is kept.
    from hfexport.artifacts.publish import _discard_previous

    program, config, _ = exported("dynamo")
    old = save(program, tmp_path / "old", config=config)
    (old / "late.txt").write_text("written after the check")
    _discard_previous(old, tmp_path / "dest")
    assert not old.exists()
    (kept,) = tmp_path.glob("dest.hfexport-kept-*")
    assert [p.name for p in kept.iterdir()] == ["late.txt"]


def _onnx_logits(path: Path, name: str) -> torch.Tensor:
    import onnxruntime as ort

    from hfexport.naming import onnx_feed

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    _, inputs = tiny(name)
    return torch.from_numpy(session.run(None, onnx_feed([i.name for i in session.get_inputs()], inputs))[0])


class _interrupt_at:
    """Ctrl-C just before a step: a KeyboardInterrupt raised from the audit hook of `event` acting on `path`
    (`os.rename` for `os.replace`'s target, `open` for a file or folder), so that step does not happen. Once per
    block. (Raised, not signalled: a real SIGINT in this process can crash it once an OpenVINO model was freed,
    see `test_a_ctrl_c_in_a_deferred_block_arrives_when_it_ends`.)"""

    _active: ClassVar[list[tuple[str, str]]] = []
    _installed: ClassVar[bool] = False

    def __init__(self, event: str, path: Path) -> None:
        self.entry = (event, str(path))
        if not _interrupt_at._installed:
            sys.addaudithook(_interrupt_at._hook)
            _interrupt_at._installed = True

    @staticmethod
    def _hook(event: str, args: tuple[Any, ...]) -> None:
        if not _interrupt_at._active or event != _interrupt_at._active[-1][0]:
            return
        target = args[1] if event == "os.rename" else args[0]
        if isinstance(target, (str, bytes, os.PathLike)) and os.fsdecode(target) == _interrupt_at._active[-1][1]:
            _interrupt_at._active.pop()
            raise KeyboardInterrupt

    def __enter__(self) -> None:
        _interrupt_at._active.append(self.entry)

    def __exit__(self, *exc: Any) -> None:
        if self.entry in _interrupt_at._active:
            _interrupt_at._active.remove(self.entry)


def _write_pair(text: str) -> Any:
    """A writer like ONNX's: the model file names its side file after itself (`<model file>.data`)."""

    def write(path: Path) -> None:
        Path(f"{path}.data").write_text(f"{text} weights")
        path.write_text(f"{text} graph, weights in {path.name}.data")

    return write


def _pair(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in sorted(folder.iterdir())}


def test_an_interrupted_pair_replacement_leaves_the_old_pair_and_nothing_else(tmp_path: Path) -> None:
    from hfexport.core.files import save_atomically

    path = tmp_path / "model.onnx"
    save_atomically(path, _write_pair("old"), side_files_named_by_main=True)
    old = _pair(tmp_path)
    # Ctrl-C just before the model file's rename: the new side file (`model.hfexport-<hex>.onnx.data`) is in
    # place by then. Before, it stayed there beside the old pair until the next export.
    with _interrupt_at("os.rename", path), pytest.raises(KeyboardInterrupt):
        save_atomically(path, _write_pair("new"), side_files_named_by_main=True)
    assert _pair(tmp_path) == old
    # Ctrl-C just after it (at the flush of the folder): the new pair is published and stays whole.
    with _interrupt_at("open", tmp_path), pytest.raises(KeyboardInterrupt):
        save_atomically(path, _write_pair("new"), side_files_named_by_main=True)
    graph = path.read_text()
    assert graph.startswith("new graph") and (tmp_path / graph.rsplit(" ", 1)[1]).read_text() == "new weights"
    # OpenVINO's way (side files found by name, replaced in place) into a new folder: nothing is left of it.
    xml = tmp_path / "new" / "sub" / "model.xml"
    with _interrupt_at("os.rename", xml), pytest.raises(KeyboardInterrupt):
        save_atomically(xml, _write_pair("new"))
    assert not (tmp_path / "new").exists()


_DEFERRED = """
import os, signal, time
from hfexport.core.files import interrupts_deferred

signal.signal(signal.SIGINT, signal.default_int_handler)
done = []
try:
    with interrupts_deferred():
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        done.append("the block ran to its end")
    print("no interrupt")
except KeyboardInterrupt:
    print("interrupted after:", done, signal.getsignal(signal.SIGINT) is signal.default_int_handler)
"""


def test_a_ctrl_c_in_a_deferred_block_arrives_when_it_ends() -> None:
    # A real SIGINT, in a fresh interpreter: in this one, once OpenVINO freed a compiled model, the main thread's
    # alternate signal stack can point at unmapped memory, and any Python signal handler (installed with
    # SA_ONSTACK) crashes the process with SIGSEGV.
    result = subprocess.run([sys.executable, "-c", _DEFERRED], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip() == "interrupted after: ['the block ran to its end'] True", result.stderr[-2000:]


def _save_onnx(program: Any, path: Path, external_data: bool = True) -> None:
    # What OnnxExporter does with `output_path`.
    from hfexport.core.files import save_atomically

    save_atomically(path, lambda p: program.save(p, external_data=external_data), side_files_named_by_main=True)


def test_replacing_an_onnx_pair_never_leaves_the_old_graph_with_new_weights(tmp_path: Path) -> None:
    llama, _, _ = exported("onnx", "tiny-llama")
    gpt2, _, _ = exported("onnx", "tiny-gpt2")
    path = tmp_path / "model.onnx"
    _save_onnx(llama, path)
    before = _onnx_logits(path, "tiny-llama")

    # Ctrl-C at the last step, the rename of the graph: everything else of the new pair is in place by then.
    with _interrupt_at("os.rename", path), pytest.raises(KeyboardInterrupt):
        _save_onnx(gpt2, path)
    assert torch.equal(_onnx_logits(path, "tiny-llama"), before), "the old pair, whole"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.data"], "and nothing else"

    _save_onnx(gpt2, path)  # the next save completes and clears what the interrupted one left
    assert_matches_eager({"logits": _onnx_logits(path, "tiny-gpt2")}, "tiny-gpt2", tiny("tiny-gpt2")[1], "onnx")
    assert len([p for p in tmp_path.iterdir() if p.name.endswith(".data")]) == 1
    _save_onnx(llama, path, external_data=False)  # no .data now: the stale one goes
    assert [p.name for p in tmp_path.iterdir()] == ["model.onnx"]
    assert torch.equal(_onnx_logits(path, "tiny-llama"), before)
