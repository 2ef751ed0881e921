"""Fuzzing saved artifacts end to end (hypothesis, derandomized): a saved artifact of every format, mutated, loads
and runs or is refused, never opens a file outside its folder and never imports what it names. Each reader on its
own, within a time and memory budget, is fuzzed in tests/test_readers_fuzz.py."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("hypothesis", reason="the fuzz tests need hypothesis (pip install hypothesis)")

from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from hfexport.artifacts import MANIFEST
from tests.fuzz_budget import watching

# Hypothesis caches what it learns under ./.hypothesis by default: keep the checkout clean.
set_hypothesis_home_dir(str(Path(tempfile.gettempdir()) / "hfexport-hypothesis"))

_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    found = [prefix] if prefix else []
    if isinstance(value, dict):
        for key, item in value.items():
            found += _paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += _paths(item, (*prefix, i))
    return found


# -- saved artifacts of every format, mutated ---------------------------------------------------------------
#
# A tiny program of each format (y = x @ W, built directly, so the default tier stays cheap) is saved with
# hfexport.save; each example mutates a copy (bytes of a file, with or without the manifest re-hashed to
# match; one manifest field; the set of files) and loads it. `load` must return a program that runs, or raise
# an ArtifactError; it must never raise anything else, never open a file outside the folder (Python-level
# opens, watched by an audit hook; the paths native runtimes read are the ones the checks allow), never import
# what the artifact names. ExecuTorch loads in a child process (its runtime can abort the process).

_X = ([2, 4], "float32")
_HOSTILE = ["../outside.data", "/etc/passwd", "evilmod.run", "evilmod:Thing", "os.system", "a\\b", "model.onnx"]


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 3, generator=torch.Generator().manual_seed(0)))

    def forward(self, x: Any) -> Any:
        return x @ self.weight


def tiny_program(export_format: str) -> Any:
    """`y = x @ W` of a fixed W as a program of `export_format` (also the readers' fuzz seed)."""
    import numpy as np

    weight = _Tiny().weight.detach().numpy()
    if export_format == "onnx":
        import onnx_ir as ir
        from onnx import TensorProto, helper, numpy_helper
        from torch.onnx import ONNXProgram

        value = helper.make_tensor_value_info
        graph = helper.make_graph(
            [helper.make_node("MatMul", ["x", "W"], ["y"])],
            "tiny",
            [value("x", TensorProto.FLOAT, [2, 4])],
            [value("y", TensorProto.FLOAT, [2, 3])],
            initializer=[numpy_helper.from_array(weight, "W")],
        )
        proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)
        return ONNXProgram(ir.serde.deserialize_model(proto), None)
    if export_format == "openvino":
        import openvino
        import openvino.opset13 as ops

        x = ops.parameter([2, 4], np.float32, name="x")
        y = ops.matmul(x, ops.constant(weight), False, False)
        y.output(0).get_tensor().set_names({"y"})
        return openvino.Model([y], [x], "tiny")
    program = torch.export.export(_Tiny().eval(), (), {"x": torch.ones(2, 4)})
    if export_format == "executorch":
        from executorch.exir import to_edge_transform_and_lower

        return to_edge_transform_and_lower(program).to_executorch()
    return program


@pytest.fixture(scope="module")
def tiny_artifacts(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    from hfexport.artifacts import save

    root = tmp_path_factory.mktemp("tiny-artifacts")
    made: dict[str, Path] = {}

    def get(export_format: str) -> Path:
        if export_format not in made:
            pytest.importorskip({"onnx": "onnxruntime"}.get(export_format, export_format.replace("dynamo", "torch")))
            made[export_format] = save(tiny_program(export_format), root / export_format, metadata={"n": 1})
        return made[export_format]

    return get


@dataclasses.dataclass
class _Mutation:
    kind: str  # bytes | field | files
    target: Any  # a file, a manifest path, or a file-set edit
    value: Any = None
    rehash: bool = True

    def __str__(self) -> str:
        return f"{self.kind} {self.target!r} {str(self.value)[:60]!r} rehash={self.rehash}"


def _mutations(manifest: dict[str, Any]) -> st.SearchStrategy[_Mutation]:
    files = sorted(manifest["files"])
    byte_edit = st.one_of(
        st.tuples(st.just("flip"), st.lists(st.tuples(st.integers(0, 1 << 20), st.integers(0, 255)), min_size=1)),
        st.tuples(st.just("truncate"), st.integers(0, 1 << 20)),
        st.tuples(st.just("append"), st.binary(min_size=1, max_size=64)),
        st.tuples(st.just("random"), st.integers(0, 1 << 30)),
    )
    return st.one_of(
        st.builds(_Mutation, st.just("bytes"), st.sampled_from(files), byte_edit, st.booleans() | st.just(True)),
        st.builds(_Mutation, st.just("field"), st.sampled_from(_paths(manifest)), _json | st.sampled_from(_HOSTILE)),
        st.builds(
            _Mutation,
            st.just("files"),
            st.sampled_from(["delete", "list-unlisted", "symlink-outside", "extra-file", "main-elsewhere"]),
            st.sampled_from(files),
        ),
    )


def _rehash(folder: Path, manifest: dict[str, Any], rel: str) -> None:
    if rel in manifest["checksums"] and (folder / rel).is_file():
        data = (folder / rel).read_bytes()
        manifest["checksums"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _apply(folder: Path, mutation: _Mutation, outside: Path) -> None:
    """Edit the copy `folder` as `mutation` says (the manifest re-hashed where the attacker would)."""
    manifest = json.loads((folder / MANIFEST).read_text())
    if mutation.kind == "bytes":
        path = folder / mutation.target
        data = bytearray(path.read_bytes())
        op, arg = mutation.value
        if op == "flip":
            for position, byte in arg:
                if data:
                    data[position % len(data)] = byte
        elif op == "truncate":
            data = data[: arg % (len(data) + 1)]
        elif op == "append":
            data += arg
        else:
            data = bytearray(random.Random(arg).randbytes(len(data)))
        path.write_bytes(bytes(data))
        if mutation.rehash:
            _rehash(folder, manifest, mutation.target)
    elif mutation.kind == "field":
        target = manifest
        for key in mutation.target[:-1]:
            target = target[key]
        target[mutation.target[-1]] = mutation.value
    else:
        rel = mutation.value
        if mutation.target == "delete":
            (folder / rel).unlink()
        elif mutation.target == "list-unlisted":
            manifest["files"].append("unlisted.bin")
            manifest["checksums"]["unlisted.bin"] = {"size": 0, "sha256": hashlib.sha256(b"").hexdigest()}
        elif mutation.target == "symlink-outside":
            outside.write_bytes((folder / rel).read_bytes())
            (folder / rel).unlink()
            (folder / rel).symlink_to(outside)
        elif mutation.target == "extra-file":
            (folder / "notes.txt").write_text("not listed, never read")
        else:  # the main file moved out of the folder, the manifest pointing there
            manifest["components"]["model"]["main"] = "../" + manifest["components"]["model"]["main"]
    (folder / MANIFEST).write_text(json.dumps(manifest))


def _run_in_process(folder: Path, trust: bool) -> str:
    """`loaded` (it loads and runs), or `refused` (an ArtifactError); anything else fails the example."""
    from hfexport.artifacts import ArtifactError, load
    from hfexport.core.errors import InputError

    outside: list[str] = []
    imported: list[str] = []
    root, here = os.path.realpath(folder.parent), os.path.realpath(folder)
    active = [True]

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if not active[0] or threading.get_ident() != thread:
            return
        if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.path.realpath(os.fsdecode(args[0]))
            if path.startswith(root + os.sep) and not path.startswith(here + os.sep):
                outside.append(path)
        elif event == "import" and args:
            imported.append(str(args[0]))

    thread = threading.get_ident()
    stop = watching(hook)
    try:
        try:
            loaded = load(folder, trust=trust)
        except ArtifactError:
            return "refused"
        try:
            loaded.run({"x": torch.ones(2, 4)})
        except InputError:  # an edited input name: hfexport's own check of what the program takes
            return "refused"
        return "loaded"
    finally:
        active[0] = False
        stop()
        assert not outside, f"opened outside the folder: {outside}"
        assert not [m for m in imported if m.startswith("evilmod")], imported


_FUZZ_EXAMPLES = 25  # per in-process format in the default tier; `-m slow` runs 300


def _fuzz_in_process(tiny_artifacts: Callable[[str], Path], export_format: str, examples: int) -> None:
    source = tiny_artifacts(export_format)
    manifest = json.loads((source / MANIFEST).read_text())
    main = manifest["components"]["model"]["main"]

    @settings(
        max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None
    )
    @given(mutation=_mutations(manifest))
    @example(mutation=_Mutation("bytes", main, ("random", 1)))
    @example(mutation=_Mutation("bytes", main, ("truncate", 10)))
    @example(mutation=_Mutation("files", "symlink-outside", main))
    def one(mutation: _Mutation) -> None:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / "artifact"
            shutil.copytree(source, folder)
            _apply(folder, mutation, Path(tmp) / "outside.data")
            try:
                _run_in_process(folder, trust=export_format == "dynamo")
            except Exception as exc:
                raise AssertionError(f"{mutation}: {type(exc).__name__}: {exc}") from exc

    one()


@pytest.mark.parametrize("export_format", ["dynamo", "onnx", "openvino"])
def test_fuzz_a_mutated_artifact_loads_and_runs_or_is_refused(
    tiny_artifacts: Callable[[str], Path], export_format: str
) -> None:
    _fuzz_in_process(tiny_artifacts, export_format, _FUZZ_EXAMPLES)


@pytest.mark.slow
@pytest.mark.parametrize("export_format", ["dynamo", "onnx", "openvino"])
def test_fuzz_many_mutated_artifacts(tiny_artifacts: Callable[[str], Path], export_format: str) -> None:
    _fuzz_in_process(tiny_artifacts, export_format, 300)


def _fuzz_in_a_child(tiny_artifacts: Callable[[str], Path], tmp_path: Path, examples: int) -> None:
    from tests.loading_child import Job, load_in_child

    source = tiny_artifacts("executorch")
    manifest = json.loads((source / MANIFEST).read_text())
    mutations: list[_Mutation] = []

    @settings(
        max_examples=examples,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
    )
    @given(mutation=_mutations(manifest))
    @example(mutation=_Mutation("bytes", "model.pte", ("random", 1)))  # the abort of issue #21
    @example(mutation=_Mutation("bytes", "model.pte", ("truncate", 100)))
    @example(mutation=_Mutation("bytes", "model.pte", ("flip", [(4, 0)])))  # the program identifier
    def draw(mutation: _Mutation) -> None:
        # Flips land anywhere, the program's flatbuffer included (hfexport/artifacts/pte.py checks its interior).
        mutations.append(mutation)

    draw()
    jobs = []
    for i, mutation in enumerate(mutations):
        folder = tmp_path / f"m{i}" / "artifact"
        shutil.copytree(source, folder)
        _apply(folder, mutation, tmp_path / f"m{i}" / "outside.data")
        jobs.append(Job(str(i), folder, inputs={"x": _X}))
    outcomes = load_in_child(jobs, watch=tmp_path)
    bad = {
        str(mutations[int(k)]): (o.kind, o.detail[:200], o.outside)
        for k, o in outcomes.items()
        if o.kind not in ("loaded", "refused", "run-failed")
        or (o.kind == "run-failed" and not o.detail.startswith("InputError"))  # hfexport's own input check
        or o.outside
        or any(m.startswith("evilmod") for m in o.imported)
    }
    assert not bad, bad


@pytest.mark.slow
def test_fuzz_a_mutated_executorch_artifact_never_aborts(tiny_artifacts: Callable[[str], Path], tmp_path: Path) -> None:
    _fuzz_in_a_child(tiny_artifacts, tmp_path, 30)


@pytest.mark.slow
def test_fuzz_many_mutated_executorch_artifacts(tiny_artifacts: Callable[[str], Path], tmp_path: Path) -> None:
    _fuzz_in_a_child(tiny_artifacts, tmp_path, 200)
