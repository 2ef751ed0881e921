"""Saved artifacts under attack and damage (issue #8, artifact parts): a loader refuses a bad manifest, a path
out of the folder, a truncated file, a `.pt2` without trust, and a manifest that names code, before it opens
any model file or imports anything. The fuzzing is in tests/test_artifacts_fuzz.py and tests/test_readers_fuzz.py.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from hfexport.artifacts import (
    MANIFEST,
    ArtifactError,
    ManifestError,
    UnsafePathError,
    UntrustedArtifactError,
    load,
    save,
)
from tests.test_save_load import _watch_opens, exported

Mutation = Callable[[dict[str, Any]], Any]


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """backend -> a saved tiny-llama artifact (made on first use, shared by the module)."""
    root = tmp_path_factory.mktemp("artifacts")
    made: dict[str, Path] = {}

    def get(backend: str) -> Path:
        if backend not in made:
            program, config, report = exported(backend)
            made[backend] = save(program, root / backend, config=config, report=report, model="tiny-llama")
        return made[backend]

    return get


def _copy(artifacts: Callable[[str], Path], backend: str, tmp_path: Path) -> Path:
    target = tmp_path / backend
    shutil.copytree(artifacts(backend), target)
    return target


def _rewrite(folder: Path, mutate: Mutation) -> None:
    manifest = json.loads((folder / MANIFEST).read_text())
    result = mutate(manifest)
    text = result if isinstance(result, str) else json.dumps(manifest)
    (folder / MANIFEST).write_text(text)


def _refresh_checksum(folder: Path, rel: str) -> None:
    manifest = json.loads((folder / MANIFEST).read_text())
    data = (folder / rel).read_bytes()
    manifest["checksums"][rel] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / MANIFEST).write_text(json.dumps(manifest))


def _assert_refused_untouched(folder: Path, error: type[Exception], match: str, **load_kwargs: Any) -> None:
    """load refuses with `error`, having opened no file of the artifact but its manifest."""
    opened: list[str] = []
    with _watch_opens(opened), pytest.raises(error, match=match):
        load(folder, **load_kwargs)
    touched = {Path(p).name for p in opened if Path(p).resolve().is_relative_to(folder.resolve())}
    assert touched <= {MANIFEST}, f"opened {touched} before refusing"


def _set(path: tuple[Any, ...], value: Any) -> Mutation:
    def mutate(manifest: dict[str, Any]) -> None:
        target = manifest
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return mutate


def _delete(path: tuple[Any, ...]) -> Mutation:
    def mutate(manifest: dict[str, Any]) -> None:
        target = manifest
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]

    return mutate


def _nested(depth: int) -> Mutation:
    def mutate(manifest: dict[str, Any]) -> str:
        return json.dumps(manifest)[:-1] + ', "metadata": {"a": ' + "[" * depth + "]" * depth + "}}"

    return mutate


# (id, mutation, exception, message) on the ONNX artifact: each a corrupt or hand-edited manifest.
SCHEMA_CASES: list[tuple[str, Mutation, type[Exception], str]] = [
    ("not-json", lambda m: "{not json", ManifestError, "not valid JSON"),
    ("json-array", lambda m: "[]", ManifestError, "a JSON object"),
    ("empty-file", lambda m: "", ManifestError, "not valid JSON"),
    ("nan", lambda m: json.dumps(m)[:-1] + ', "metadata": {"x": NaN}}', ManifestError, "not JSON"),
    ("deep-nesting", _nested(100_000), ManifestError, "not valid JSON|deeper than"),
    ("nested-33", _nested(40), ManifestError, "deeper than"),
    ("no-version", _delete(("manifest_version",)), ManifestError, "misses required key"),
    ("future-version", _set(("manifest_version",), 2), ManifestError, "manifest_version 2 is not supported"),
    ("version-as-string", _set(("manifest_version",), "1"), ManifestError, "must be int, got str"),
    ("version-as-bool", _set(("manifest_version",), True), ManifestError, "must be int, got bool"),
    ("unknown-format", _set(("format",), "tflite"), ManifestError, "not one of"),
    ("no-components", _set(("components",), {}), ManifestError, "components is empty"),
    ("files-not-list", _set(("files",), "model.onnx"), ManifestError, "must be list"),
    ("file-listed-twice", lambda m: m["files"].append(m["files"][0]), ManifestError, "twice"),
    ("checksum-missing", lambda m: m["checksums"].pop("report.json"), ManifestError, "one entry per file"),
    ("checksum-not-hex", _set(("checksums", "model.onnx", "sha256"), "z" * 64), ManifestError, "64 hex digits"),
    ("component-not-object", _set(("components", "model"), ["model.onnx"]), ManifestError, "must be an object"),
    ("component-no-main", _delete(("components", "model", "main")), ManifestError, "misses required key"),
    ("main-not-in-files", _set(("components", "model", "main"), "other.onnx"), ManifestError, "not one of its files"),
    ("main-wrong-kind", _set(("components", "model", "main"), "report.json"), ManifestError, "is not a .onnx"),
    ("component-format", _set(("components", "model", "format"), "openvino"), ManifestError, "differs from"),
    ("input-not-string", _set(("components", "model", "inputs"), [1]), ManifestError, "must be a string"),
    ("component-name", lambda m: m["components"].update({"a/b": m["components"]["model"]}), ManifestError, "name"),
    ("config-unknown-field", _set(("config", "compress_to_fp16"), False), ManifestError, "not fields of the onnx"),
    ("config-other-format", _set(("config", "export_format"), "dynamo"), ManifestError, "the artifact is onnx"),
    ("dunder-key", _set(("metadata",), {"__reduce__": []}), ManifestError, "names code"),
    ("hydra-target", _set(("report",), {"_target_": "x"}), ManifestError, "names code"),
    ("versions-not-strings", _set(("versions",), {"torch": 2}), ManifestError, "must be a string"),
]


@pytest.mark.parametrize(("mutate", "error", "match"), [pytest.param(*case[1:], id=case[0]) for case in SCHEMA_CASES])
def test_a_corrupt_or_edited_manifest_is_refused_before_any_model_file_is_opened(
    artifacts: Callable[[str], Path], tmp_path: Path, mutate: Mutation, error: type[Exception], match: str
) -> None:
    folder = _copy(artifacts, "onnx", tmp_path)
    _rewrite(folder, mutate)
    _assert_refused_untouched(folder, error, match)


PATH_CASES: list[tuple[str, str]] = [
    ("dotdot", "../outside.onnx.data"),
    ("dotdot-inside", "sub/../../outside.onnx.data"),
    ("absolute", "/etc/passwd"),
    ("windows-drive", "C:/Windows/win.ini"),
    ("backslash", "..\\outside.onnx.data"),
    ("dot", "./model.onnx.data"),
]


@pytest.mark.parametrize("path", [pytest.param(p, id=i) for i, p in PATH_CASES])
@pytest.mark.parametrize("where", ["files", "component-files", "main"])
def test_a_path_that_leaves_the_folder_is_refused(
    artifacts: Callable[[str], Path], tmp_path: Path, path: str, where: str
) -> None:
    folder = _copy(artifacts, "onnx", tmp_path)
    (tmp_path / "outside.onnx.data").write_bytes(b"secret")

    def mutate(manifest: dict[str, Any]) -> None:
        if where == "files":
            manifest["files"][1] = path
        elif where == "component-files":
            manifest["components"]["model"]["files"][1] = path
        else:
            manifest["components"]["model"]["main"] = path

    _rewrite(folder, mutate)
    _assert_refused_untouched(folder, UnsafePathError, "absolute|'\\.\\.'|backslash")


def test_a_symlink_out_of_the_folder_is_refused_even_with_matching_checksums(
    artifacts: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = _copy(artifacts, "onnx", tmp_path)
    outside = tmp_path / "elsewhere.data"
    shutil.copy(folder / "model.onnx.data", outside)
    (folder / "model.onnx.data").unlink()
    (folder / "model.onnx.data").symlink_to(outside)
    _assert_refused_untouched(folder, UnsafePathError, "leads outside")


def test_onnx_external_data_named_outside_the_manifest_is_refused(artifacts: Callable[[str], Path], tmp_path: Path):
    # The .onnx names its weight file itself: an attacker who re-hashes everything still cannot point it out.
    import onnx

    folder = _copy(artifacts, "onnx", tmp_path)
    proto = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    for tensor in onnx.external_data_helper._get_all_tensors(proto):
        for entry in tensor.external_data:
            if entry.key == "location":
                entry.value = "../stolen.data"
    onnx.save(proto, str(folder / "model.onnx"))
    _refresh_checksum(folder, "model.onnx")
    with pytest.raises(UnsafePathError, match=r"stolen\.data"):
        load(folder)


# ExecuTorch's artifact costs a minute's lowering (`Backend.slow_lowering`): its cases run in the slow tier.
@pytest.mark.parametrize("backend", ["onnx", pytest.param("executorch", marks=pytest.mark.slow), "openvino"])
@pytest.mark.parametrize(
    "where",
    ["new-top-level-key", "new-component-key", "config-value", "metadata", "format", "model-class", "own-module"],
)
def test_a_manifest_naming_code_is_refused_without_importing_or_running_it(
    artifacts: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str, where: str
) -> None:
    # A module that proves it ran: importing it writes a marker file.
    marker = tmp_path / "ran"
    (tmp_path / "evilmod.py").write_text(f"open({str(marker)!r}, 'w').write('pwned')\ndef run(*a): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    folder = _copy(artifacts, backend, tmp_path)
    edits: dict[str, tuple[Mutation, str]] = {
        "new-top-level-key": (_set(("loader",), "os.system"), "unknown key"),
        "new-component-key": (_set(("components", "model", "runtime"), "os.system"), "unknown key"),
        "config-value": (_set(("config", "strict"), "os.system"), "name of Python code"),
        "metadata": (_set(("metadata",), {"on_load": ["builtins:eval", "print(1)"]}), "name of Python code"),
        "format": (_set(("format",), "os.system"), "not one of"),
        "model-class": (_set(("model_class",), "subprocess.Popen"), "name of Python code"),
        "own-module": (_set(("metadata",), {"hook": "evilmod.run"}), "name of Python code"),
    }
    mutate, match = edits[where]
    _rewrite(folder, mutate)
    events: list[str] = []
    # Audit hooks are process-wide: only this thread's events count (`load` runs here, synchronously). A
    # worker pool that an earlier test left behind (a background thread forking) is not the loader.
    loader_thread = threading.get_ident()

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if not watching or threading.get_ident() != loader_thread:
            return
        if event in ("os.system", "subprocess.Popen", "os.exec", "os.posix_spawn", "os.fork", "exec"):
            events.append(event)

    watching = True
    sys.addaudithook(hook)
    try:
        _assert_refused_untouched(folder, ManifestError, match)
    finally:
        watching = False
    assert events == [] and not marker.exists() and "evilmod" not in sys.modules


def test_a_quantizer_record_in_the_config_is_data_and_loads(artifacts: Callable[[str], Path], tmp_path: Path):
    # configs record which quantizer ran (module and class, for people); it is never rebuilt, so it may name one.
    folder = _copy(artifacts, "openvino", tmp_path)
    record = {"class": "NNCFOpenVINOQuantizer", "module": "hfexport.quantizers.nncf", "settings": {"x": "torch.int8"}}
    _rewrite(folder, _set(("config", "quantizer"), record))
    assert load(folder, open_runtimes=False).config["quantizer"] == record
    _rewrite(folder, _set(("config", "dynamic_shapes"), {"input_ids": {"0": "torch.export.Dim"}}))
    with pytest.raises(ManifestError, match="name of Python code"):
        load(folder, open_runtimes=False)


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        pytest.param(_set(("generation",), {"components": {}}), "missing key", id="missing-keys"),
        pytest.param(_set(("generation",), {"__init__": 1}), "names code", id="dunder"),
    ],
)
def test_a_bad_generation_layout_is_refused(
    artifacts: Callable[[str], Path], tmp_path: Path, mutate: Mutation, match: str
) -> None:
    folder = _copy(artifacts, "onnx", tmp_path)
    _rewrite(folder, mutate)
    _assert_refused_untouched(folder, ManifestError, match)


@pytest.mark.parametrize(
    ("backend", "file"),
    [("onnx", "model.onnx"), pytest.param("executorch", "model.pte", marks=pytest.mark.slow)],  # a minute's lowering
)
def test_a_truncated_model_file_is_refused(
    artifacts: Callable[[str], Path], tmp_path: Path, backend: str, file: str
) -> None:
    folder = _copy(artifacts, backend, tmp_path)
    data = (folder / file).read_bytes()
    (folder / file).write_bytes(data[: len(data) // 2])
    with pytest.raises(ArtifactError, match="truncated or replaced"):
        load(folder)
    # Re-hashed to match (a manifest written after the damage): the runtime's refusal, as an ArtifactError.
    _refresh_checksum(folder, file)
    with pytest.raises(ArtifactError, match=r"not a readable ONNX model|a truncated program"):
        load(folder)


def test_a_swapped_weight_file_of_the_same_size_fails_the_checksum(artifacts: Callable[[str], Path], tmp_path: Path):
    folder = _copy(artifacts, "openvino", tmp_path)
    weights = bytearray((folder / "model.bin").read_bytes())
    weights[len(weights) // 2] ^= 0xFF
    (folder / "model.bin").write_bytes(bytes(weights))
    with pytest.raises(ArtifactError, match="sha256"):
        load(folder)
    assert load(folder, verify=False).run  # sizes match: verify=False is the caller's choice to skip hashing


def test_pt2_without_trust_and_missing_pieces(artifacts: Callable[[str], Path], tmp_path: Path) -> None:
    folder = _copy(artifacts, "dynamo", tmp_path)
    _assert_refused_untouched(folder, UntrustedArtifactError, "trust=True")
    (folder / "model.pt2").unlink()
    with pytest.raises(ArtifactError, match=r"misses 'model\.pt2'"):
        load(folder, trust=True)
    (folder / MANIFEST).unlink()
    with pytest.raises(ArtifactError, match=r"no manifest\.json"):
        load(folder, trust=True)
    with pytest.raises(ArtifactError, match="not a folder"):
        load(tmp_path / "nowhere")


def _many_dotted_names(manifest: dict[str, Any]) -> None:
    manifest["metadata"] = {"names": [f"mod{i}.attr" for i in range(100_000)]}


def _many_files(manifest: dict[str, Any]) -> None:
    for i in range(20_000):
        manifest["files"].append(f"f{i}.bin")
        manifest["checksums"][f"f{i}.bin"] = {"size": 0, "sha256": "0" * 64}


def _padded(manifest: dict[str, Any]) -> str:
    return json.dumps(manifest)[:-1] + ', "metadata": {"pad": "' + "x" * (9 * 1024 * 1024) + '"}}'


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        pytest.param(_many_dotted_names, "distinct names shaped like import paths", id="100k-dotted-names"),
        pytest.param(_many_files, "lists 20", id="20k-files"),
        pytest.param(_padded, "bytes; a manifest is at most", id="9MiB"),
    ],
)
def test_a_hostile_manifest_is_refused_quickly(
    artifacts: Callable[[str], Path], tmp_path: Path, mutate: Mutation, match: str
) -> None:
    # Sizes and counts are capped before any per-name work: the refusal costs well under a second.
    import time

    folder = _copy(artifacts, "onnx", tmp_path)
    _rewrite(folder, mutate)
    start = time.perf_counter()
    _assert_refused_untouched(folder, ManifestError, match)
    assert time.perf_counter() - start < 1.5


def _external(name: str, data: bytes, dims: list[int], location: str) -> Any:
    import onnx

    tensor = onnx.TensorProto(name=name, data_type=onnx.TensorProto.FLOAT, dims=dims)
    tensor.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", str(len(data)))):
        tensor.external_data.add(key=key, value=value)
    return tensor


def _sparse_reading(folder: Path, where: str, location: str = "unlisted.data") -> None:
    """Make model.onnx read one of its weights (a layer norm's) from `location` through a sparse tensor."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    proto = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    graph = proto.graph
    weight = next(t for t in graph.initializer if t.name == "model.layers.0.input_layernorm.weight")  # inline
    values = numpy_helper.to_array(weight).astype(np.float32)
    (folder / location.split("/")[-1]).write_bytes(values.tobytes())
    indices = numpy_helper.from_array(np.arange(values.size, dtype=np.int64), weight.name + ".idx")
    sparse = helper.make_sparse_tensor(
        _external(weight.name, values.tobytes(), [values.size], location), indices, list(values.shape)
    )
    graph.initializer.remove(weight)
    if where == "sparse-initializer":
        graph.sparse_initializer.append(sparse)
    elif where == "sparse-attribute":
        graph.node.insert(0, helper.make_node("Constant", [], [weight.name], sparse_value=sparse))
    else:  # a sparse constant inside an If's branches: a subgraph
        branch = helper.make_graph(
            [helper.make_node("Constant", [], ["branch_out"], sparse_value=sparse)],
            "branch",
            [],
            [helper.make_tensor_value_info("branch_out", onnx.TensorProto.FLOAT, list(values.shape))],
        )
        graph.initializer.append(numpy_helper.from_array(np.array(True), "always"))
        graph.node.insert(0, helper.make_node("If", ["always"], [weight.name], then_branch=branch, else_branch=branch))
    onnx.save(proto, str(folder / "model.onnx"))
    _refresh_checksum(folder, "model.onnx")


@pytest.mark.parametrize("where", ["sparse-initializer", "sparse-attribute", "sparse-in-subgraph"])
def test_onnx_external_data_in_sparse_tensors_must_be_listed(
    artifacts: Callable[[str], Path], tmp_path: Path, where: str
) -> None:
    # ONNX Runtime reads a sparse tensor's external values like any other: a file the manifest does not list
    # would hold weights whose changes no checksum sees.
    folder = _copy(artifacts, "onnx", tmp_path)
    _sparse_reading(folder, where)
    with pytest.raises(UnsafePathError, match=r"unlisted\.data.*does not list"):
        load(folder)


def test_onnx_external_data_out_of_its_file_or_through_a_hard_link_is_refused(
    artifacts: Callable[[str], Path], tmp_path: Path
) -> None:
    import onnx

    folder = _copy(artifacts, "onnx", tmp_path)
    proto = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    tensor = next(t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL)
    offset = next(e for e in tensor.external_data if e.key == "offset")
    offset.value = str(10**9)
    onnx.save(proto, str(folder / "model.onnx"))
    _refresh_checksum(folder, "model.onnx")
    with pytest.raises(ArtifactError, match="past the end of"):
        load(folder)

    folder = _copy(artifacts, "onnx", tmp_path / "linked")
    outside = tmp_path / "outside.data"
    (folder / "model.onnx.data").rename(outside)
    (folder / "model.onnx.data").hardlink_to(outside)  # same bytes, same checksum, a name outside the folder
    with pytest.raises(UnsafePathError, match="hard link"):
        load(folder)


# Every model file of every format, replaced by random bytes or cut short, with the manifest re-hashed to match:
# a refusal in `load` (checked before the runtime sees the file), never an abort of the process.
# ExecuTorch's in the slow tier (a minute's lowering; tests/test_pte_structure.py and the .pte fuzzer check the
# structure check itself in the default tier).
DAMAGED_FILES = [
    ("dynamo", "model.pt2"),
    ("onnx", "model.onnx"),
    ("onnx", "model.onnx.data"),
    ("openvino", "model.xml"),
    ("openvino", "model.bin"),
]


@pytest.mark.parametrize(
    "damaged_files",
    [
        pytest.param(DAMAGED_FILES, id="default"),
        pytest.param([("executorch", "model.pte")], id="executorch", marks=pytest.mark.slow),
    ],
)
def test_a_model_file_of_random_bytes_or_cut_short_is_refused_never_an_abort(
    artifacts: Callable[[str], Path], tmp_path: Path, damaged_files: list[tuple[str, str]]
) -> None:
    import random

    from tests.loading_child import Job, load_in_child

    jobs = []
    for backend, file in damaged_files:
        for damage in ("random", "truncated", "empty"):
            folder = _copy(artifacts, backend, tmp_path / f"{file}-{damage}")
            data = (folder / file).read_bytes()
            rng = random.Random(f"{file}-{damage}")
            damaged = {
                "random": bytes(rng.getrandbits(8) for _ in range(len(data))),
                "truncated": data[: len(data) // 2],
                "empty": b"",
            }[damage]
            (folder / file).write_bytes(damaged)
            _refresh_checksum(folder, file)
            jobs.append(Job(f"{file}-{damage}", folder, trust=backend == "dynamo"))
    outcomes = load_in_child(jobs, watch=tmp_path)
    # Random bytes of the right size in a weight file are weights: such an artifact may load (and run).
    weights = ("model.onnx.data-random", "model.bin-random")
    expected = {job.id: {"refused", "loaded"} if job.id in weights else {"refused"} for job in jobs}
    found = {job.id: outcomes[job.id].kind for job in jobs}
    assert all(found[k] in expected[k] for k in found), {k: (v.kind, v.detail[:300]) for k, v in outcomes.items()}
    # A damaged model file is refused by hfexport's own check of its format, not by a runtime's error text.
    for job in jobs:
        if not job.id.startswith(("model.onnx.data", "model.bin")):
            assert "does not load in the" not in outcomes[job.id].detail, (job.id, outcomes[job.id].detail[:300])


def _generation(**changes: Any) -> dict[str, Any]:
    """A valid generation layout for the one component of a single export, with `changes` (a.b=... by path)."""
    leaf = {"name": "past_key_values.layers_0_keys", "shape": [2, 2, 8, 8], "dtype": "float32"}
    component = {"inputs": ["input_ids"], "constants": {}, "mask_rank": 2, "cache_leaves": [leaf], "layout": {}}
    spec: dict[str, Any] = {
        "components": {"model": component},
        "cache_key": "past_key_values",
        "static_cache": False,
        "max_cache_len": None,
        "multi_token_decode": False,
        "sample_batch": 2,
        "eos_token_id": [2],
        "pad_token_id": 0,
        "positions": None,
    }
    for path, value in changes.items():
        target = spec
        keys = path.split(".")
        for key in keys[:-1]:
            target = target[int(key)] if isinstance(target, list) else target[key]
        target[keys[-1]] = value
    return spec


_POSITIONS = {"type_key": None, "token_ids": [5], "text_row": True, "blocks": [], "decode_rows": 3}
_LEAF = "components.model.cache_leaves.0"
GENERATION_VALUE_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("dtype-unknown", {f"{_LEAF}.dtype": "float33"}, "dtype"),
    ("dtype-not-a-dtype", {f"{_LEAF}.dtype": "Tensor"}, "dtype"),
    ("shape-negative", {f"{_LEAF}.shape": [2, -1, 8, 8]}, "shape"),
    ("shape-not-ints", {f"{_LEAF}.shape": [2, 1.5]}, "shape"),
    ("shape-absurd", {f"{_LEAF}.shape": [64, 64, 4096, 256]}, "elements"),
    ("shape-rank", {f"{_LEAF}.shape": [1] * 20}, "shape"),
    ("leaf-name", {f"{_LEAF}.name": 7}, "name"),
    ("mask-rank", {"components.model.mask_rank": 99}, "mask_rank"),
    ("inputs-not-names", {"components.model.inputs": [1]}, "inputs"),
    ("layout-huge", {"components.model.layout": {"image_grid_thw": [[1, 2, 3]] * 100}}, "layout"),
    ("leaves-not-names", {"components.model.leaves": {"encoder_outputs": [0]}}, "leaves"),
    ("leaves-not-an-object", {"components.model.leaves": ["encoder_outputs.0"]}, "leaves"),
    ("sample-batch", {"sample_batch": 0}, "sample_batch"),
    ("max-cache-len", {"max_cache_len": -5}, "max_cache_len"),
    ("static-cache-flag", {"static_cache": "yes"}, "static_cache"),
    ("cache-key", {"cache_key": 5}, "cache_key"),
    ("eos-ids", {"eos_token_id": ["a"]}, "eos_token_id"),
    ("positions-unknown-key", {"positions": {**_POSITIONS, "hook": 1}}, "positions"),
    ("positions-block-key", {"positions": {**_POSITIONS, "blocks": [{"token_type": 1}]}}, "blocks"),
    ("positions-rows", {"positions": {**_POSITIONS, "decode_rows": -2}}, "decode_rows"),
]


def test_a_valid_generation_layout_loads(artifacts: Callable[[str], Path], tmp_path: Path) -> None:
    folder = _copy(artifacts, "onnx", tmp_path)
    _rewrite(folder, _set(("generation",), _generation(positions=_POSITIONS)))
    spec = load(folder, open_runtimes=False).generation
    assert spec.components["model"].cache_leaves[0].shape == [2, 2, 8, 8] and spec.positions.decode_rows == 3


@pytest.mark.parametrize(("changes", "match"), [pytest.param(c, m, id=i) for i, c, m in GENERATION_VALUE_CASES])
def test_a_generation_layout_with_bad_values_is_refused_at_load(
    artifacts: Callable[[str], Path], tmp_path: Path, changes: dict[str, Any], match: str
) -> None:
    folder = _copy(artifacts, "onnx", tmp_path)
    _rewrite(folder, _set(("generation",), _generation(**changes)))
    _assert_refused_untouched(folder, ManifestError, match)


NOT_CACHE_CLASSES = ["evilmod:Thing", "os:_wrap_close", "transformers.configuration_utils:PretrainedConfig"]


@pytest.mark.parametrize("named", NOT_CACHE_CLASSES)
def test_a_pt2_whose_cache_context_names_another_class_is_refused_even_with_trust(
    artifacts: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, named: str
) -> None:
    # The pytree context of a cache names its classes; the decoder resolves only transformers' cache classes,
    # whatever the trust flag (trust is consent to pickle, not to importing what a file names).
    import zipfile

    from tests.test_save_load import tiny

    marker = tmp_path / "ran"
    (tmp_path / "evilmod.py").write_text(f"open({str(marker)!r}, 'w').write('pwned')\nclass Thing: pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    folder = _copy(artifacts, "dynamo", tmp_path)
    archive = folder / "model.pt2"
    with zipfile.ZipFile(archive) as source:
        members = {info: source.read(info) for info in source.infolist()}
    with zipfile.ZipFile(archive, "w") as target:
        for info, data in members.items():
            target.writestr(info, data.replace(b"transformers.cache_utils:DynamicCache", named.encode()))
    _refresh_checksum(folder, "model.pt2")
    with pytest.raises(ArtifactError, match="not a transformers cache class"):
        load(folder, trust=True).run(tiny("tiny-llama")[1])
    assert not marker.exists() and "evilmod" not in sys.modules


def test_the_cache_allow_list_takes_every_class_of_transformers_cache_module() -> None:
    # NemotronH's cache holds `DummyLayer`s, which derive from no abstract cache class: refusing them broke its
    # export (the generation sweep's one regression after the allow-list).
    import transformers.cache_utils as cache_utils

    from hfexport.core.cache_classes import CacheContextError, resolve_class

    assert resolve_class("transformers.cache_utils:DummyLayer") is cache_utils.DummyLayer
    with pytest.raises(CacheContextError):
        resolve_class("transformers.configuration_utils:PretrainedConfig")


def test_a_cache_class_a_modeling_module_defines_outside_cache_is_a_pytree_node() -> None:
    # Reformer's forward returns a `ReformerDynamicCache` (a plain object, no `Cache` base); torch.export refused
    # it as an output ("not a known type") until model-defined cache classes became pytree nodes too.
    import torch
    from torch.utils import _pytree as pytree
    from transformers.models.reformer.modeling_reformer import ReformerDynamicCache, ReformerModel

    from hfexport.core.cache_classes import CacheContextError, is_model_cache_class, resolve_class
    from hfexport.core.cache_pytree import register_cache_pytrees

    assert is_model_cache_class(ReformerDynamicCache)
    assert not is_model_cache_class(ReformerModel)  # a module, not a cache
    register_cache_pytrees()
    assert ReformerDynamicCache in pytree.SUPPORTED_NODES

    class Step(torch.nn.Module):
        def forward(self, states: torch.Tensor, buckets: torch.Tensor) -> tuple[torch.Tensor, Any]:
            cache = ReformerDynamicCache()
            cache.update(buckets * 2, states + 1, 0)
            return states.sum(-1), cache

    states, buckets = torch.randn(2, 5, 4), torch.arange(10).reshape(2, 5)
    program = torch.export.export(Step(), (states, buckets))
    total, cache = program.module()(states, buckets)
    assert torch.equal(total, states.sum(-1)) and isinstance(cache, ReformerDynamicCache)
    assert torch.equal(cache.states_cache[0], states + 1) and torch.equal(cache.buckets_cache[0], buckets * 2)
    assert resolve_class("transformers.models.reformer.modeling_reformer:ReformerDynamicCache") is ReformerDynamicCache
    with pytest.raises(CacheContextError):  # a non-cache class of the same module stays refused
        resolve_class("transformers.models.reformer.modeling_reformer:ReformerModel")


def test_a_cache_that_holds_its_models_config_round_trips_and_only_config_classes_load() -> None:
    # xLSTM's cache keeps `self.config`: its context named `xLSTMConfig`, which the cache allow-list refused at
    # load (found by the corpus: xlstm and xlstm@chunk_size=3). The config is carried as its JSON and rebuilt by
    # its class, which must be a config class of a transformers configuration module.
    import torch
    from transformers import xLSTMConfig
    from transformers.models.xlstm.modeling_xlstm import xLSTMCache

    from hfexport.core.cache_classes import CacheContextError
    from hfexport.core.cache_context import dump_context, load_context
    from hfexport.core.cache_pytree import flatten_cache, unflatten_cache

    config = xLSTMConfig(hidden_size=32, embedding_dim=32, num_heads=2, num_blocks=2, vocab_size=64)
    cache = xLSTMCache(config, max_batch_size=2, dtype=torch.float32)
    leaves, skeleton = flatten_cache(cache)
    again = unflatten_cache(leaves, load_context(dump_context(skeleton)))
    assert isinstance(again.config, xLSTMConfig) and again.config.to_dict() == config.to_dict()
    assert flatten_cache(again)[1] == skeleton  # the same context: a program traced with it accepts the copy
    config_node = next(sub for name, sub in skeleton[2] if name == "config")
    for named in ("transformers.models.xlstm.modeling_xlstm:xLSTMCache", "builtins:dict"):
        bad = (*skeleton[:2], tuple((n, ("G", named, config_node[2]) if n == "config" else s) for n, s in skeleton[2]))
        with pytest.raises(CacheContextError, match="not a transformers config class"):
            load_context(dump_context(bad))
