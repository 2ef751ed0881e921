"""Fuzzing every reader of untrusted bytes, each example within a budget (hypothesis, derandomized).

The readers: the manifest (`read_manifest`, `check_manifest`), the `.pte` structure check, safetensors headers and
their index (`Checkpoint.open`, also compared with the safetensors library), an artifact's ONNX external data and
OpenVINO IR pair (`hfexport.load`, then a run), the Hugging Face config files an artifact lists
(`AutoExportedModel.from_pretrained`), and the CLI's model-folder probe (what `hfexport export --model FOLDER`
reads before it loads any weight). Each gets inputs shaped like what it reads, then broken, and runs within a
`Budget` (tests/fuzz_budget.py): only the library's own error types (`hfexport.core.errors`,
`hfexport.artifacts.errors`, the CLI's `UsageError`), no file opened outside the example's folder, no module
imported or code run from it, no process started, and bounded time and memory per example. The default tier runs
a short fuzz of each reader; `-m slow` runs `_LONG` examples each. The saved artifacts, mutated and loaded end to
end, are fuzzed in tests/test_artifacts_fuzz.py.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
import shutil
import struct
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("hypothesis", reason="the fuzz tests need hypothesis (pip install hypothesis)")

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.configuration import set_hypothesis_home_dir

from hfexport.artifacts import MANIFEST, ArtifactError, ManifestError, check_manifest, load, read_manifest
from hfexport.core.checkpoints import _SAFETENSORS_DTYPES, INDEX_FILE, SINGLE_FILE, Checkpoint
from hfexport.core.errors import ConfigError, InputError
from tests.flatbuffer_programs import Shape, Table, program, write
from tests.fuzz_budget import Budget
from tests.test_artifacts_fuzz import tiny_program

# Hypothesis caches what it learns under ./.hypothesis by default: keep the checkout clean.
set_hypothesis_home_dir(str(Path(tempfile.gettempdir()) / "hfexport-hypothesis"))

_LONG = 500  # examples per reader in the slow tier


def _settings(examples: int) -> settings:
    return settings(
        max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None
    )


def _tiers(quick: int) -> Any:
    """Parametrize a fuzz test over the default tier's `quick` examples and the slow tier's `_LONG`."""
    return pytest.mark.parametrize(
        "examples", [pytest.param(quick, id="short"), pytest.param(_LONG, id="long", marks=pytest.mark.slow)]
    )


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)
_HOSTILE_TEXT = ["../outside.data", "/etc/passwd", "evilmod.run", "evilmod:Thing", "os.system", "a\\b", "\x00", "é"]
_HOSTILE_INTS = [-1, 0, 1, 2**31, 2**32 + 4, 2**63, 2**64, -(2**63), 10**30]


def _rehash(folder: Path, *names: str) -> None:
    """Re-compute the manifest's size and sha256 of `names`, as someone who can rewrite the manifest would."""
    manifest = json.loads((folder / MANIFEST).read_text())
    for name in names:
        data = (folder / name).read_bytes()
        manifest["checksums"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / MANIFEST).write_text(json.dumps(manifest))


def _edit_json(value: Any, path: list[Any], new: Any) -> Any:
    """`value` with the item at `path` (keys and indices, followed as far as they go) replaced by `new`."""
    if not path or not isinstance(value, (dict, list)) or not value:
        return new
    if isinstance(value, dict):
        key = list(value)[path[0] % len(value)] if isinstance(path[0], int) else path[0]
        return {**value, key: _edit_json(value.get(key), path[1:], new)}
    index = path[0] % len(value) if isinstance(path[0], int) else 0
    return [*value[:index], _edit_json(value[index], path[1:], new), *value[index + 1 :]]


_json_edits = st.lists(
    st.tuples(st.lists(st.integers(0, 30) | st.text(max_size=8), max_size=4), _json | st.sampled_from(_HOSTILE_TEXT)),
    min_size=1,
    max_size=3,
)


# -- the manifest --------------------------------------------------------------------------------------------

_MANIFEST_BUDGET = Budget("manifest", seconds=2, mib=64)
_VALID = {
    "manifest_version": 1,
    "format": "onnx",
    "components": {
        "model": {
            "format": "onnx",
            "main": "model.onnx",
            "files": ["model.onnx"],
            "inputs": ["input_ids"],
            "outputs": ["logits"],
            "config": None,
            "report": None,
        }
    },
    "files": ["model.onnx"],
    "checksums": {"model.onnx": {"size": 1, "sha256": "0" * 64}},
    "config": {"export_format": "onnx", "dynamic": True},
    "versions": {"torch": "2.13.0"},
}


def _big_manifest(kind: str, count: int) -> Any:
    """A manifest grown along one axis: many files, deep nesting, many dotted names, a long string."""
    manifest = copy.deepcopy(_VALID)
    if kind == "files":
        names = [f"f{i}.bin" for i in range(count)]
        manifest["files"] += names
        manifest["checksums"].update({n: {"size": 0, "sha256": "0" * 64} for n in names})
    elif kind == "nesting":
        text = json.dumps({**manifest, "metadata": {"deep": "DEEP"}})
        return text.replace('"DEEP"', "[" * count + "1" + "]" * count)
    elif kind == "dotted":
        manifest["metadata"] = {f"k{i}": f"pkg{i}.attr" for i in range(count)}
    else:
        manifest["metadata"] = {"long": "x" * count * 100}
    return manifest


@_tiers(60)
def test_fuzz_read_manifest_within_budget(examples: int, tmp_path: Path) -> None:
    """Arbitrary bytes and JSON, one field of a valid manifest edited, and manifests grown past every cap: only
    `ManifestError` (an `ArtifactError`), in well under the budget."""
    counter = iter(range(1 << 30))
    (tmp_path / "warm").mkdir()
    (tmp_path / "warm" / MANIFEST).write_text(json.dumps(_VALID))
    _MANIFEST_BUDGET.warm(lambda: read_manifest(tmp_path / "warm"), (ManifestError,))

    @_settings(examples)
    @given(
        raw=st.one_of(
            st.binary(max_size=300),
            _json.map(lambda v: json.dumps(v).encode()),
            _json_edits.map(lambda edits: _edited(_VALID, edits)),
            st.tuples(st.sampled_from(["files", "nesting", "dotted", "long"]), st.sampled_from([10, 300, 12_000])).map(
                lambda grown: _manifest_text(_big_manifest(*grown))
            ),
        )
    )
    @example(raw=b"[" * 100_000 + b"]" * 100_000)
    @example(raw=_manifest_text(_big_manifest("files", 20_000)))
    def one(raw: bytes) -> None:
        folder = tmp_path / str(next(counter)) / "artifact"
        folder.mkdir(parents=True)
        (folder / MANIFEST).write_bytes(raw)
        _MANIFEST_BUDGET.run(lambda: read_manifest(folder), folder, (ManifestError,), raw[:100])

    one()


def _manifest_text(manifest: Any) -> bytes:
    return (manifest if isinstance(manifest, str) else json.dumps(manifest)).encode()


def _edited(value: Any, edits: list[tuple[list[Any], Any]]) -> bytes:
    for path, new in edits:
        value = _edit_json(value, path, new)
    return json.dumps(value).encode()


@_tiers(100)
def test_fuzz_check_manifest_on_arbitrary_json_within_budget(examples: int) -> None:
    @_settings(examples)
    @given(data=_json | _json_edits.map(lambda edits: json.loads(_edited(_VALID, edits))))
    def one(data: Any) -> None:
        _MANIFEST_BUDGET.run(lambda: check_manifest(data), None, (ManifestError,), data)

    one()


def test_the_fuzz_seed_manifest_is_valid() -> None:
    assert check_manifest(copy.deepcopy(_VALID))["format"] == "onnx"


# -- the export config a manifest records (`AutoExportConfig.from_dict`) ---------------------------------------


def _config_fields() -> list[str]:
    from hfexport.auto import AUTO_CONFIG_MAPPING

    return sorted({f.name for cls in AUTO_CONFIG_MAPPING.values() for f in fields(cls)})


_CONFIG_BUDGET = Budget("export config", seconds=2, mib=32)


@_tiers(100)
def test_fuzz_auto_export_config_from_dict_within_budget(examples: int) -> None:
    """Real and random field names with JSON values: only `ConfigError` or `ValueError` (an unknown format)."""
    from hfexport.auto import AutoExportConfig

    _CONFIG_BUDGET.warm(lambda: AutoExportConfig.from_dict({"export_format": "onnx"}), ())

    @_settings(examples)
    @given(
        fmt=st.sampled_from(["dynamo", "onnx", "executorch", "openvino"]) | _json,
        data=st.dictionaries(st.sampled_from(_config_fields()) | st.text(max_size=6), _json, max_size=4),
    )
    def one(fmt: Any, data: dict[str, Any]) -> None:
        config = {"export_format": fmt, **data}
        _CONFIG_BUDGET.run(lambda: AutoExportConfig.from_dict(config), None, (ConfigError, ValueError), config)

    one()


@pytest.mark.parametrize(
    "data",
    [
        pytest.param({"export_format": "dynamo", "dynamic_shapes": [1]}, id="dynamic-shapes-list"),
        pytest.param({"export_format": "onnx", "dynamic_shapes": 5}, id="dynamic-shapes-number"),
        pytest.param({"export_format": "dynamo", "dynamic_shapes": {"x": {"0": "NOPE"}}}, id="unknown-dim-name"),
        pytest.param({"export_format": {}}, id="unhashable-format"),
        pytest.param({"export_format": "dynamo", "rules": {"nope": []}}, id="rules-unknown-key"),
        pytest.param({"export_format": "dynamo", "dynamic": "yes"}, id="bool-field-string"),
        pytest.param({"export_format": "onnx", "opset_version": 1.5}, id="int-field-float"),
    ],
)
def test_auto_export_config_from_dict_known_bad_inputs_raise_documented_errors(data: dict[str, Any]) -> None:
    from hfexport.auto import AutoExportConfig

    with pytest.raises((ConfigError, ValueError)):
        AutoExportConfig.from_dict(data)


# -- the .pte structure check --------------------------------------------------------------------------------

_PTE_BUDGET = Budget(".pte structure", seconds=1, mib=32)
_SCALARS = st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7, 8, 11, 12, 30, 99, 255]) | st.integers(-(2**31), 2**31 - 1)
_NAMES = [b"forward", b"aten::mm", b"out", b"aten::add", b"executorch_prim::add", b"\xff\xfe", b"", b"x" * 120]


@st.composite
def _flatbuffer_tables(draw: st.DrawFn) -> Table:
    """A root table over a pool of tables whose references pick earlier ones (so tables are shared), of fields of
    every kind in every slot: what the reader must survive, not what ExecuTorch writes."""
    pool: list[Table] = []
    for _ in range(draw(st.integers(1, 10))):
        fields: dict[int, tuple[str, Any]] = {}
        for slot in draw(st.lists(st.integers(0, 11), max_size=6, unique=True)):
            kinds = ["u8", "i32", "i64", "ints", "longs", "bytes", "text"] + (["ref", "refs"] if pool else [])
            kind = draw(st.sampled_from(kinds))
            if kind == "ref":
                fields[slot] = (kind, pool[draw(st.integers(0, len(pool) - 1))])
            elif kind == "refs":
                picks = draw(st.lists(st.integers(0, len(pool) - 1), max_size=40))
                fields[slot] = (kind, [pool[i] for i in picks])
            elif kind in ("ints", "longs", "bytes"):
                low, high = {"ints": (-(2**31), 2**31 - 1), "longs": (-(2**63), 2**63 - 1), "bytes": (0, 255)}[kind]
                fields[slot] = (kind, draw(st.lists(st.integers(0, 12) | st.integers(low, high), max_size=20)))
            elif kind == "text":
                fields[slot] = (kind, draw(st.sampled_from(_NAMES) | st.binary(max_size=16)))
            else:
                value = draw(_SCALARS)
                fields[slot] = (kind, value % 256 if kind == "u8" else value)
        pool.append(Table(fields))
    return pool[-1]


def _unknown_operator() -> bytes:
    """A program calling an operator torch does not know: the first check of one imports ExecuTorch's libraries."""
    method = Table({0: ("text", b"forward"), 6: ("refs", [Table({0: ("text", b"zz::nope")})])})
    return write(Table({1: ("refs", [method])}))


def _check_pte_bytes(data: bytes) -> None:
    from hfexport.artifacts.pte import check_program

    check_program(data, len(data), 0, "model.pte")


@_tiers(60)
def test_fuzz_pte_structure_on_arbitrary_flatbuffers_within_budget(examples: int) -> None:
    """Flatbuffers of any tables and fields, shared between references, and consistent programs whose plans,
    chains, instructions and lists share tables: refused with `ArtifactError` or passed, within a second each."""
    pytest.importorskip("flatbuffers")
    _PTE_BUDGET.warm(lambda: _check_pte_bytes(_unknown_operator()), (ArtifactError,))

    @_settings(examples)
    @given(
        data=_flatbuffer_tables().map(write)
        | st.builds(
            Shape, st.integers(1, 8), st.integers(1, 8), st.integers(1, 8), st.integers(0, 50), st.integers(0, 50)
        ).map(program)
    )
    @example(data=program(Shape(plans=700, chains=700, instructions=700)))
    def one(data: bytes) -> None:
        _PTE_BUDGET.run(lambda: _check_pte_bytes(data), None, (ArtifactError,), f"{len(data)} bytes")

    one()


@pytest.fixture(scope="module")
def real_pte() -> bytes:
    """The tiny `y = x @ W` program (portable kernels), as ExecuTorch writes it."""
    pytest.importorskip("executorch")
    from executorch.exir import to_edge_transform_and_lower

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(4, 3, generator=torch.Generator().manual_seed(0)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight

    exported = torch.export.export(Tiny().eval(), (), {"x": torch.ones(2, 4)})
    return bytes(to_edge_transform_and_lower(exported).to_executorch().buffer)


@_tiers(100)
def test_fuzz_pte_structure_on_edits_of_a_real_program_within_budget(examples: int, real_pte: bytes, tmp_path: Path):
    """Bytes of a real program overwritten anywhere (its header included), as `load` checks it: `ArtifactError`
    or passed, within a second each (whether the runtime then runs it is tests/test_artifacts_fuzz.py's)."""
    from hfexport.backends.executorch.artifact import check_pte

    counter = iter(range(1 << 30))
    (tmp_path / "warm").mkdir()
    (tmp_path / "warm" / "model.pte").write_bytes(real_pte)
    _PTE_BUDGET.warm(lambda: check_pte(tmp_path / "warm", {"main": "model.pte"}), (ArtifactError,))

    @_settings(examples)
    @given(flips=st.lists(st.tuples(st.integers(0, len(real_pte) - 1), st.integers(0, 255)), min_size=1, max_size=8))
    def one(flips: list[tuple[int, int]]) -> None:
        data = bytearray(real_pte)
        for position, byte in flips:
            data[position] = byte
        folder = tmp_path / str(next(counter))
        folder.mkdir()
        (folder / "model.pte").write_bytes(bytes(data))
        _PTE_BUDGET.run(lambda: check_pte(folder, {"main": "model.pte"}), folder, (ArtifactError,), flips)

    one()


# -- safetensors headers and their index ---------------------------------------------------------------------

_HEADER_BUDGET = Budget("safetensors header", seconds=1, mib=32)
_INDEX_BUDGET = Budget("safetensors index", seconds=1, mib=32)
_DTYPES = sorted(_SAFETENSORS_DTYPES)
_header_edits = st.lists(
    st.one_of(
        st.tuples(
            st.just("field"), st.integers(0, 9), st.sampled_from(["dtype", "shape", "data_offsets", "x", ""])
        ).flatmap(lambda t: st.tuples(st.just(t), _json | st.sampled_from(_HOSTILE_INTS) | st.sampled_from(["U16"]))),
        st.tuples(st.tuples(st.just("offset"), st.integers(0, 9), st.integers(0, 1)), st.integers(-9, 9)),
        st.tuples(st.tuples(st.just("metadata")), _json),
        st.tuples(st.tuples(st.just("data")), st.integers(-9, 9)),
        st.tuples(st.tuples(st.just("length")), st.integers(-9, 9) | st.sampled_from([2**31, 2**63])),
        st.tuples(st.tuples(st.just("raw")), st.binary(max_size=64)),
        st.tuples(st.tuples(st.just("duplicate")), st.integers(0, 9)),
        st.tuples(st.tuples(st.just("not-utf8")), st.integers(0, 200)),
    ),
    max_size=3,
)


@st.composite
def _safetensors_files(draw: st.DrawFn) -> tuple[bytes, list[Any]]:
    """A valid safetensors file of 0-4 tensors (random bytes), then 0-3 edits of its header, offsets or data."""
    header: dict[str, Any] = {}
    offset = 0
    for i in range(draw(st.integers(0, 4))):
        dtype = draw(st.sampled_from(_DTYPES))
        shape = draw(st.lists(st.integers(0, 3), max_size=3))
        size = math.prod(shape) * _SAFETENSORS_DTYPES[dtype].itemsize
        header[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    if draw(st.booleans()):
        header["__metadata__"] = {"format": "pt"}
    data = draw(st.binary(min_size=offset, max_size=offset))
    edits = draw(_header_edits)
    names = [n for n in header if n != "__metadata__"]
    raw: bytes | None = None
    length_delta = 0
    for (kind, *where), value in edits:
        if kind == "field" and names:
            header[names[where[0] % len(names)]] = {**header[names[where[0] % len(names)]], where[1]: value}
        elif kind == "offset" and names:
            entry = header[names[where[0] % len(names)]]
            if isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2:
                offsets = list(entry["data_offsets"])
                if all(type(o) is int for o in offsets):
                    offsets[where[1]] += value
                    header[names[where[0] % len(names)]] = {**entry, "data_offsets": offsets}
        elif kind == "metadata":
            header["__metadata__"] = value
        elif kind == "data":
            data = data[: max(0, len(data) + value)] if value < 0 else data + bytes(value)
        elif kind == "length":
            length_delta = value
        elif kind == "raw":
            raw = value
        elif kind == "duplicate" and names:
            name = names[value % len(names)]
            text = json.dumps(header)
            raw = (text[:-1] + f', "{name}": ' + json.dumps(header[name]) + "}").encode()
        elif kind == "not-utf8":
            text = (raw or json.dumps(header).encode()) + b" "
            raw = text[: value % len(text)] + b"\xff" + text[value % len(text) :]
    text = raw if raw is not None else json.dumps(header).encode()
    length = max(0, len(text) + length_delta) if length_delta < 2**31 else length_delta
    return struct.pack("<Q", length % 2**64) + text + data, edits


def _safe_open_tensors(path: Path) -> dict[str, torch.Tensor] | None:
    """Every tensor of the file as the safetensors library reads it, or None when it refuses the file."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as handle:
            return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    except Exception:
        return None


def _bytes_of(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@_tiers(200)
def test_fuzz_safetensors_headers_agree_with_the_safetensors_library(examples: int, tmp_path: Path) -> None:
    """`Checkpoint.open` raises only `InputError`, within budget, and accepts exactly what `safe_open` accepts
    (but dtypes the export does not read): a file it accepts reads, tensor by tensor and row block by row block,
    the bytes safetensors reads."""
    counter = iter(range(1 << 30))

    @_settings(examples)
    @given(made=_safetensors_files())
    def one(made: tuple[bytes, list[Any]]) -> None:
        content, edits = made
        folder = tmp_path / str(next(counter))
        folder.mkdir()
        path = folder / SINGLE_FILE
        path.write_bytes(content)
        checkpoint = _HEADER_BUDGET.run(lambda: Checkpoint.open(folder), folder, (InputError,), edits)
        expected = _safe_open_tensors(path)
        if checkpoint is None:
            readable = expected is not None and all(t.dtype in _SAFETENSORS_DTYPES.values() for t in expected.values())
            assert not readable, f"refused a file safetensors reads: {edits}"
            return
        assert expected is not None, f"accepted a file safetensors refuses: {edits}"
        assert set(checkpoint.tensors) == set(expected)
        for name, tensor in expected.items():
            assert (
                checkpoint.tensors[name].shape == tuple(tensor.shape) and checkpoint.tensors[name].dtype == tensor.dtype
            )
            assert _bytes_of(checkpoint.load(name)) == _bytes_of(tensor)
            rows = b"".join(_bytes_of(block) for block in checkpoint.load_rows(name, max_bytes=4))
            assert rows == _bytes_of(tensor)

    one()


def _shard(tensors: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(path))


_SHARD_NAMES = ["a.safetensors", "b.safetensors", "../outside.safetensors", "/etc/passwd", "link.safetensors"]
_SHARD_NAMES += [
    "sub/../../outside.safetensors",
    "",
    ".",
    "sub",
    "missing.safetensors",
    "a.safetensors/",
    "./a.safetensors",
]


@_tiers(150)
def test_fuzz_safetensors_index_within_budget(examples: int, tmp_path: Path) -> None:
    """An index whose `weight_map` names shards in and out of the folder (a symlink out, `..`, absolute paths),
    or that is no index at all: only `InputError`, and nothing outside the folder is opened."""
    counter = iter(range(1 << 30))
    source = tmp_path / "source"
    source.mkdir()
    _shard({"w": torch.ones(2)}, source / "a.safetensors")
    _shard({"v": torch.zeros(3)}, source / "b.safetensors")

    @_settings(examples)
    @given(
        index=st.one_of(
            st.dictionaries(st.text(max_size=4), st.sampled_from(_SHARD_NAMES) | _json, max_size=5).map(
                lambda weight_map: json.dumps({"metadata": {}, "weight_map": weight_map}).encode()
            ),
            _json_edits.map(lambda edits: _edited({"weight_map": {"w": "a.safetensors"}}, edits)),
            st.binary(max_size=100),
        )
    )
    @example(index=json.dumps({"weight_map": {"w": "link.safetensors"}}).encode())
    def one(index: bytes) -> None:
        root = tmp_path / str(next(counter))
        folder = root / "model"
        shutil.copytree(source, folder)
        (folder / "sub").mkdir()
        _shard({"secret": torch.ones(1)}, root / "outside.safetensors")
        (folder / "link.safetensors").symlink_to(root / "outside.safetensors")
        (folder / INDEX_FILE).write_bytes(index)
        _INDEX_BUDGET.run(lambda: Checkpoint.open(folder), folder, (InputError,), index[:200])

    one()


# -- an artifact's ONNX external data ------------------------------------------------------------------------

_ONNX_BUDGET = Budget("onnx external data", seconds=5, mib=64)
_STREAMED_BUDGET = Budget("low-memory onnx check", seconds=2, mib=32)
_LOCATIONS = ["model.onnx.data", "../outside.data", "/etc/passwd", "sub/../../outside.data", "", ".", "model.onnx"]
_LOCATIONS += ["unlisted.data", "extra.data", "a\\b", "./model.onnx.data", "C:/x", "x" * 300, "/proc/self/environ"]
_NUMBERS = st.sampled_from(["0", "-1", "24", "48", "1e3", "", "abc", str(2**63), str(2**64 + 1), " 8", "0x10", "٣"])


@pytest.fixture(scope="module")
def onnx_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny `y = x @ W` ONNX program saved with its weight as external data, and an extra listed file."""
    pytest.importorskip("onnxruntime")
    import onnx

    from hfexport.artifacts import save

    folder = save(tiny_program("onnx"), tmp_path_factory.mktemp("onnx") / "artifact")
    # The save keeps a weight this small inside model.onnx: move it to model.onnx.data, as a large one is.
    proto = onnx.load(str(folder / "model.onnx"))
    weight = proto.graph.initializer[0]
    (folder / "model.onnx.data").write_bytes(weight.raw_data)
    weight.data_location = onnx.TensorProto.EXTERNAL
    for key, value in (("location", "model.onnx.data"), ("offset", "0"), ("length", str(len(weight.raw_data)))):
        entry = weight.external_data.add()
        entry.key, entry.value = key, value
    weight.ClearField("raw_data")
    (folder / "model.onnx").write_bytes(proto.SerializeToString())
    (folder / "extra.data").write_bytes(bytes(range(64)))
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["files"].append("extra.data")
    manifest["components"]["model"]["files"].append("extra.data")
    (folder / MANIFEST).write_text(json.dumps(manifest))
    _rehash(folder, "model.onnx", "model.onnx.data", "extra.data")
    assert load(folder).run({"x": torch.ones(2, 4)})["y"].shape == (2, 3)
    return folder


_onnx_edits = st.lists(
    st.one_of(
        st.tuples(st.just("entry"), st.sampled_from(["location", "offset", "length", "checksum", "other"])).flatmap(
            lambda t: st.tuples(st.just(t), st.sampled_from(_LOCATIONS) | _NUMBERS | st.text(max_size=6))
        ),
        st.tuples(st.tuples(st.just("drop"), st.sampled_from(["location", "offset", "length"])), st.none()),
        st.tuples(st.tuples(st.just("external-constant")), st.sampled_from(_LOCATIONS)),
        st.tuples(st.tuples(st.just("external-sparse")), st.sampled_from(_LOCATIONS)),
        st.tuples(st.tuples(st.just("inline")), st.binary(max_size=64)),
        st.tuples(st.tuples(st.just("rename-input")), st.sampled_from(["u1", "y", "W", ""])),
        st.tuples(
            st.tuples(st.just("record")),
            _json.map(json.dumps) | st.sampled_from(['{"W": ["nope", null]}', '{"W": ["w", [2, 0]]}', "{", "[]"]),
        ),
    ),
    min_size=1,
    max_size=3,
)


def _apply_onnx_edits(proto: Any, edits: list[Any]) -> None:
    from onnx import TensorProto, helper

    weight = proto.graph.initializer[0]

    def external(tensor: Any, location: str) -> None:
        tensor.data_location = TensorProto.EXTERNAL
        del tensor.external_data[:]
        for key, value in (("location", location), ("offset", "0"), ("length", "48")):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value

    for (kind, *where), value in edits:
        if kind == "entry":
            entries = {e.key: e for e in weight.external_data}
            entry = entries.get(where[0]) or weight.external_data.add()
            entry.key, entry.value = where[0], value
        elif kind == "drop":
            kept = [(e.key, e.value) for e in weight.external_data if e.key != where[0]]
            del weight.external_data[:]
            for key, item in kept:
                entry = weight.external_data.add()
                entry.key, entry.value = key, item
        elif kind == "external-constant":
            tensor = helper.make_tensor("c", TensorProto.FLOAT, [12], [0.0] * 12)
            external(tensor, value)
            proto.graph.node.append(helper.make_node("Constant", [], ["c_out"], value=tensor))
        elif kind == "external-sparse":
            values = helper.make_tensor("sv", TensorProto.FLOAT, [2], [1.0, 2.0])
            external(values, value)
            indices = helper.make_tensor("si", TensorProto.INT64, [2], [0, 5])
            proto.graph.sparse_initializer.append(helper.make_sparse_tensor(values, indices, [12]))
        elif kind == "record":
            proto.metadata_props[0].value = value
        elif kind == "rename-input":
            proto.graph.input[0].name = value
            proto.graph.node[0].input[0] = value
        else:
            weight.data_location = TensorProto.DEFAULT
            weight.raw_data = value


@_tiers(30)
def test_fuzz_onnx_external_data_within_budget(examples: int, onnx_artifact: Path, tmp_path: Path) -> None:
    """An artifact's `.onnx` whose external data names files in and out of the folder, with offsets and lengths
    of any text, re-hashed: `load` and a run raise only `ArtifactError` (or the run's `InputError`), read nothing
    outside the folder, and stay within budget."""
    import onnx

    from hfexport.artifacts.low_memory import check_streamed_weights
    from hfexport.lowerings.onnx import STREAMED_KEY
    from tests.test_artifacts_fuzz import _Tiny

    proto = onnx.load(str(onnx_artifact / "model.onnx"), load_external_data=False)
    # As a low-memory export records it: W holds checkpoint tensor `w` (the checkpoint beside the artifact).
    record = proto.metadata_props.add()
    record.key, record.value = STREAMED_KEY, json.dumps({"W": ["w", None]})
    (tmp_path / "checkpoint").mkdir()
    _shard({"w": _Tiny().weight.detach()}, tmp_path / "checkpoint" / SINGLE_FILE)
    checkpoint = Checkpoint.open(tmp_path / "checkpoint")
    counter = iter(range(1 << 30))
    _ONNX_BUDGET.warm(lambda: load(onnx_artifact).run({"x": torch.ones(2, 4)}), ())

    @_settings(examples)
    @given(edits=_onnx_edits)
    @example(edits=[(("entry", "length"), str(2**62))])
    @example(edits=[(("entry", "location"), "../outside.data")])
    @example(edits=[(("rename-input",), "u1")])
    @example(edits=[])
    def one(edits: list[Any]) -> None:
        root = tmp_path / str(next(counter))
        folder = root / "artifact"
        shutil.copytree(onnx_artifact, folder)
        (folder / "unlisted.data").write_bytes(bytes(64))
        (folder / "sub").mkdir()
        (root / "outside.data").write_bytes(bytes(64))
        edited = copy.deepcopy(proto)
        _apply_onnx_edits(edited, edits)
        (folder / "model.onnx").write_bytes(edited.SerializeToString())
        _rehash(folder, "model.onnx")
        _ONNX_BUDGET.run(lambda: load(folder).run({"x": torch.ones(2, 4)}), folder, (ArtifactError, InputError), edits)
        # The low-memory export's own check of the file it wrote reads the same external data.
        result = _STREAMED_BUDGET.run(
            lambda: check_streamed_weights(folder / "model.onnx", checkpoint), folder, (ArtifactError,), edits
        )
        if not edits:  # the unedited file: its one streamed weight holds the checkpoint's bytes
            assert result.ok and result.checked == ["W"]

    one()


# -- an artifact's OpenVINO IR pair --------------------------------------------------------------------------

_OPENVINO_BUDGET = Budget("openvino ir", seconds=5, mib=64)
_ATTRIBUTE_VALUES = ["-1", "0", "1", "99999999999999999999", "18446744073709551615", "4294967296", "", "abc", "1.5"]
_ATTRIBUTE_VALUES += ["2,4,-3", "0,0", "1,1,1,1,1,1,1,1,1,1", "f64", "u1", "string", "dynamic", "?", "-1,-1"]
_ATTRIBUTE_VALUES += ["9223372036854775807", "FP64", "I4", "u4", "nf4", "&amp;", "x" * 500]


@pytest.fixture(scope="module")
def openvino_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("openvino")
    from hfexport.artifacts import save

    return save(tiny_program("openvino"), tmp_path_factory.mktemp("openvino") / "artifact")


_xml_edits = st.lists(
    st.one_of(
        st.tuples(st.tuples(st.just("attribute"), st.integers(0, 200)), st.sampled_from(_ATTRIBUTE_VALUES)),
        st.tuples(st.tuples(st.just("dim"), st.integers(0, 50)), st.sampled_from(_ATTRIBUTE_VALUES)),
        st.tuples(st.tuples(st.just("name")), st.sampled_from(["x", "y", "u1", "?", "", "x,y"])),
        st.tuples(st.tuples(st.just("doctype")), st.sampled_from(["<!DOCTYPE net>", '<!DOCTYPE n [<!ENTITY a "b">]>'])),
        st.tuples(st.tuples(st.just("nest")), st.sampled_from([10, 1000, 20_000])),
        st.tuples(st.tuples(st.just("drop")), st.integers(0, 50)),
        st.tuples(st.tuples(st.just("bin")), st.integers(-24, 24)),
    ),
    min_size=1,
    max_size=3,
)


def _apply_xml_edits(xml: str, binary: bytes, edits: list[Any]) -> tuple[str, bytes]:
    patterns = {
        "attribute": (r'(\w[\w-]*)="([^"]*)"', 2),
        "dim": (r"<dim>([^<]*)</dim>", 1),
        "drop": (r"<(layer|edge)\b[^>]*?(/>|>.*?</layer>)", 0),
    }
    for (kind, *where), value in edits:
        if kind in patterns:
            pattern, group = patterns[kind]
            spans = [m.span(group) for m in re.finditer(pattern, xml, re.DOTALL)]
            if spans:
                start, end = spans[(where[0] if where else value) % len(spans)]
                xml = xml[:start] + ("" if kind == "drop" else value) + xml[end:]
        elif kind == "name":
            xml = xml.replace('names="x"', f'names="{value}"')
        elif kind == "doctype":
            xml = xml.replace("?>", "?>" + value, 1)
        elif kind == "nest":
            xml = xml.replace("<layers>", "<layers>" + "<x>" * value + "</x>" * value, 1)
        else:
            binary = binary[: len(binary) + value] if value < 0 else binary + bytes(value)
    return xml, binary


@_tiers(30)
def test_fuzz_openvino_ir_within_budget(examples: int, openvino_artifact: Path, tmp_path: Path) -> None:
    """An artifact's `.xml`/`.bin` with attributes and dimensions of any value, a DTD, deep nesting, a layer or
    edge dropped, the weights cut or grown, re-hashed: `load` and a run raise only `ArtifactError` (or the run's
    `InputError`), within budget."""
    xml = (openvino_artifact / "model.xml").read_text()
    binary = (openvino_artifact / "model.bin").read_bytes()
    counter = iter(range(1 << 30))
    _OPENVINO_BUDGET.warm(lambda: load(openvino_artifact).run({"x": torch.ones(2, 4)}), ())

    @_settings(examples)
    @given(edits=_xml_edits)
    @example(edits=[(("name",), "u1")])  # the input's name: the IR no longer takes what the manifest says
    def one(edits: list[Any]) -> None:
        folder = tmp_path / str(next(counter)) / "artifact"
        shutil.copytree(openvino_artifact, folder)
        edited_xml, edited_bin = _apply_xml_edits(xml, binary, edits)
        (folder / "model.xml").write_text(edited_xml)
        (folder / "model.bin").write_bytes(edited_bin)
        _rehash(folder, "model.xml", "model.bin")
        _OPENVINO_BUDGET.run(
            lambda: load(folder).run({"x": torch.ones(2, 4)}), folder, (ArtifactError, InputError), edits
        )

    one()


# -- the Hugging Face files an artifact lists ----------------------------------------------------------------

_HF_BUDGET = Budget("hf config files", seconds=3, mib=64)
_TINY_LLAMA_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
}
_HF_HOSTILE = [
    {"AutoConfig": "evilmod.EvilConfig"},
    ["evilmod.Evil"],
    "../outside.json",
    "/etc/passwd",
    "evilmod",
    {"model_type": "llama"},
]


@pytest.fixture(scope="module")
def hf_artifact(onnx_artifact: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny ONNX artifact with a config.json and a generation_config.json listed, and a module `evilmod.py`
    (listed, re-hashed) that a config may name."""
    folder = tmp_path_factory.mktemp("hf") / "artifact"
    shutil.copytree(onnx_artifact, folder)
    files = {
        "config.json": json.dumps(_TINY_LLAMA_CONFIG),
        "generation_config.json": json.dumps({"bos_token_id": 1, "eos_token_id": 2}),
        "evilmod.py": "raise SystemExit('evilmod ran')\n",
    }
    manifest = json.loads((folder / MANIFEST).read_text())
    for name, text in files.items():
        (folder / name).write_text(text)
        manifest["files"].append(name)
    (folder / MANIFEST).write_text(json.dumps(manifest))
    _rehash(folder, *files)
    return folder


@_tiers(40)
def test_fuzz_the_hf_config_files_of_an_artifact_within_budget(examples: int, hf_artifact: Path, tmp_path: Path):
    """An artifact's listed config.json / generation_config.json edited (a field of any JSON, `auto_map` naming a
    module of the folder, arbitrary bytes), re-hashed: `AutoExportedModel.from_pretrained` raises only
    `ArtifactError`, never imports the module, and stays within budget."""
    from hfexport.modeling import AutoExportedModel

    counter = iter(range(1 << 30))
    files = {name: json.loads((hf_artifact / name).read_text()) for name in ("config.json", "generation_config.json")}
    _HF_BUDGET.warm(lambda: AutoExportedModel.from_pretrained(hf_artifact), ())

    @_settings(examples)
    @given(
        name=st.sampled_from(sorted(files)),
        content=st.one_of(
            st.lists(
                st.tuples(
                    st.lists(st.sampled_from(["auto_map", "model_type", "architectures", "vocab_size"]), max_size=1)
                    | st.lists(st.integers(0, 30) | st.text(max_size=8), max_size=3),
                    _json | st.sampled_from(_HF_HOSTILE),
                ),
                min_size=1,
                max_size=3,
            ),
            st.binary(max_size=200),
        ),
    )
    @example(name="config.json", content=[(["auto_map"], {"AutoConfig": "evilmod.EvilConfig"})])
    @example(name="config.json", content=[([], None)])  # null: was TypeError from transformers
    @example(name="config.json", content=[(["num_hidden_layers"], [1])])  # was StrictDataclassFieldValidationError
    @example(name="config.json", content=[(["architectures"], [["x"]])])  # was AttributeError in `_class_for`
    @example(name="generation_config.json", content=b"\x8c\xfb")  # was OSError ("not a valid JSON file")
    def one(name: str, content: Any) -> None:
        folder = tmp_path / str(next(counter)) / "artifact"
        shutil.copytree(hf_artifact, folder)
        data = content if isinstance(content, bytes) else _edited(files[name], content)
        (folder / name).write_bytes(data)
        _rehash(folder, name)
        _HF_BUDGET.run(lambda: AutoExportedModel.from_pretrained(folder), folder, (ArtifactError,), (name, content))

    one()


# -- the CLI's model-folder probe ----------------------------------------------------------------------------

_PROBE_BUDGET = Budget("cli folder probe", seconds=5, mib=128)


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama folder as `save_pretrained` writes it, with a word-level tokenizer and a preprocessor config."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder = tmp_path_factory.mktemp("model") / "model"
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**_TINY_LLAMA_CONFIG)).save_pretrained(folder)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, 128)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="</s>")
    tokenizer.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps({"crop_size": 8, "num_channels": 3}))
    return folder


def _probe(folder: Path, task: str) -> Any:
    """What `hfexport export --model FOLDER --task TASK` reads before it loads weights: the folder check, the
    low-memory decision (the checkpoint's headers), and the sample inputs (config, tokenizer, preprocessor)."""
    from hfexport.cli.models import check_model_spec, sample_inputs
    from hfexport.core.checkpoints import low_memory_reason

    check_model_spec(str(folder), task)
    low_memory_reason(folder, available=1 << 40)
    return sample_inputs(str(folder), task=task, batch_size=2, sequence_length=4)


@_tiers(40)
def test_fuzz_the_cli_model_folder_probe_within_budget(examples: int, model_folder: Path, tmp_path: Path) -> None:
    """A model folder whose config, tokenizer or preprocessor files are edited (a field of any JSON, a module of
    the folder named in `auto_map`, arbitrary bytes): the probe raises only the CLI's `UsageError` or the library's
    errors, never imports the module, never reads outside the folder, and stays within budget."""
    from hfexport.cli.exits import UsageError
    from hfexport.cli.models import TASK_CHOICES

    names = ["config.json", "tokenizer_config.json", "tokenizer.json", "preprocessor_config.json"]
    files = {name: json.loads((model_folder / name).read_text()) for name in names}
    counter = iter(range(1 << 30))
    for task in ("auto", "image-classification"):
        _PROBE_BUDGET.warm(lambda task=task: _probe(model_folder, task), ())

    @_settings(examples)
    @given(
        name=st.sampled_from(names),
        task=st.sampled_from(["auto", "causal-lm", "image-classification", "speech-seq2seq", "image-text-to-text"])
        | st.sampled_from(TASK_CHOICES),
        content=st.one_of(
            st.lists(
                st.tuples(
                    st.lists(st.sampled_from(["auto_map", "model_type", "architectures", "crop_size"]), max_size=1)
                    | st.lists(st.integers(0, 30) | st.text(max_size=8), max_size=3),
                    _json | st.sampled_from([*_HF_HOSTILE, *_HOSTILE_INTS]),
                ),
                min_size=1,
                max_size=3,
            ),
            st.binary(max_size=200),
        ),
    )
    @example(name="config.json", task="auto", content=[(["auto_map"], {"AutoConfig": "evilmod.EvilConfig"})])
    def one(name: str, task: str, content: Any) -> None:
        root = tmp_path / str(next(counter))
        folder = root / "model"
        shutil.copytree(model_folder, folder)
        (folder / "evilmod.py").write_text("raise SystemExit('evilmod ran')\n")
        (root / "outside.json").write_text("{}")
        data = content if isinstance(content, bytes) else _edited(files[name], content)
        (folder / name).write_bytes(data)

        def read() -> Any:
            try:
                return _probe(folder, task)
            except (UsageError, InputError, ConfigError):
                raise
            except Exception as exc:  # recorded below: the security properties are checked all the same
                raw.setdefault(type(exc).__name__, f"{name}, --task {task}: {' '.join(str(exc).split())}"[:160])
                return None

        _PROBE_BUDGET.run(read, folder, (UsageError, InputError, ConfigError), (name, task, content))

    raw: dict[str, str] = {}
    one()
    # A malformed file is a usage error (exit 2, one line), never a raw exception of transformers or json (exit 3).
    assert not raw, f"the folder probe raised {len(raw)} kinds of raw exceptions: {raw}"
