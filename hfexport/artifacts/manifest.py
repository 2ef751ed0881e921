"""The manifest of a saved export: its schema, the checks that refuse anything else, reading and updating it.

The manifest is data, never code. `check_manifest` refuses, before any model file is opened: a manifest that
is not a JSON object of the documented schema (unknown keys included), a file path that is absolute or has
`..`, a config key that is not a field of the format's config, and a string in the config or metadata
shaped like an import path of an importable module (`os.system`), and a generation layout whose values are not of
their types and bounds. Sizes and counts (`MAX_MANIFEST_BYTES`, `MAX_VALUES`, `MAX_FILES`, `MAX_COMPONENTS`,
`MAX_CODE_LOOKUPS`) are capped before any per-name work. `check_files` then refuses a listed file
that escapes the folder through a symlink, is missing, or whose size or sha256 differs from the manifest.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import sys
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from hfexport.artifacts.errors import ArtifactError, ManifestError, UnsafePathError
from hfexport.artifacts.formats import ARTIFACT_FORMATS
from hfexport.artifacts.paths import check_path
from hfexport.core.files import digest, is_inside, write_text_atomically
from hfexport.formats import FORMATS, MAIN_FILE

MANIFEST = "manifest.json"
REPORT = "report.json"
MANIFEST_VERSION = 1
SINGLE = "model"  # the component name of a single (not multi-component) export
# A manifest is small (names, config, rule report: tens of KiB); anything much larger is not one of ours.
# Sizes and counts are capped before any per-name work, so a hostile manifest costs milliseconds to refuse.
MAX_MANIFEST_BYTES = 4 * 1024 * 1024
MAX_DEPTH = 32
MAX_VALUES = 200_000  # JSON values (objects, lists, strings, numbers) in the whole manifest
MAX_FILES = 10_000
MAX_COMPONENTS = 1_000
# Distinct top-level names looked up on sys.path by the code-name check (each lookup reads folders).
MAX_CODE_LOOKUPS = 256
COMPONENT_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
# `os.system`, `builtins:eval`, `subprocess.Popen`: the shape of a reference to a Python object.
_IMPORT_PATH = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*(?::[A-Za-z_][\w.]*)?$")
_FILE_SUFFIXES = {"onnx", "data", "pte", "pt2", "xml", "bin", "json", "safetensors", "txt", "csv", "html", "png"}
# Keys that serialisers (pickle-alikes, jsonpickle, Hydra) use to make data build objects.
_CODE_KEYS = ("_target_", "py/object", "py/reduce", "py/function", "py/type", "!!python")


def to_plain(value: Any) -> Any:
    """JSON-ready plain data: to_dict() of configs and reports, no objects."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if hasattr(value, "to_dict"):
        return to_plain(value.to_dict())
    if isinstance(value, Mapping):
        return {str(k): to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    return str(value)


# -- the manifest schema -----------------------------------------------------------------------------------

_TOP_KEYS: dict[str, tuple[type, ...]] = {
    # key: allowed types (NoneType where optional)
    "manifest_version": (int,),
    "format": (str,),
    "components": (dict,),
    "files": (list,),
    "checksums": (dict,),
    "model": (str, type(None)),
    "model_class": (str, type(None)),
    "model_type": (str, type(None)),
    "versions": (dict,),
    "config": (dict, type(None)),
    "report": (dict, type(None)),
    "validation": (dict, type(None)),
    "metadata": (dict, type(None)),
    "created": (str,),
    "inputs": (list,),
    "outputs": (list,),
    "generation": (dict, type(None)),
}
_REQUIRED = ("manifest_version", "format", "components", "files", "checksums")
_COMPONENT_KEYS: dict[str, tuple[type, ...]] = {
    "format": (str,),
    "main": (str,),
    "files": (list,),
    "inputs": (list,),
    "outputs": (list,),
    "config": (dict, type(None)),
    "report": (dict, type(None)),
    # The method of the main file this component runs, where one file holds several (`ArtifactFormat.methods`:
    # an ExecuTorch program with a method per component); absent: the file's only one.
    "method": (str,),
}
_COMPONENT_REQUIRED = ("format", "main", "files", "inputs", "outputs")


def _count_values(value: Any) -> int:
    """The number of JSON values in `value`, stopping one past MAX_VALUES (no per-value work but counting)."""
    count = 0
    stack = [value]
    while stack and count <= MAX_VALUES:
        item = stack.pop()
        count += 1
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return count


def _check_plain(value: Any, where: str, depth: int = 0) -> None:
    """Only JSON's own types, nested at most MAX_DEPTH deep, with no object-building keys."""
    if depth > MAX_DEPTH:
        raise ManifestError(f"{where} is nested deeper than {MAX_DEPTH} levels")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise ManifestError(f"{where} has a non-string key {key!r}")
            if key.startswith("__") or key in _CODE_KEYS or key.startswith("!!python"):
                raise ManifestError(f"{where} has the key {key!r}, which names code; a manifest is plain data")
            _check_plain(item, f"{where}.{key}", depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]", depth + 1)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ManifestError(f"{where} is {value}, not a finite number")
    elif value is not None and not isinstance(value, (str, int, bool)):
        raise ManifestError(f"{where} is a {type(value).__name__}, not plain JSON data")


def _importable(top: str) -> bool:
    if top in sys.stdlib_module_names or top in sys.builtin_module_names or top in sys.modules:
        return True
    try:
        # A top-level name is looked up on sys.path without running any code.
        return importlib.util.find_spec(top) is not None
    except (ImportError, ValueError):
        return False


class _Lookups:
    """The code-name check's sys.path lookups of one manifest: each top-level name once, at most MAX_CODE_LOOKUPS."""

    def __init__(self) -> None:
        self.found: dict[str, bool] = {}

    def importable(self, top: str) -> bool:
        if top not in self.found:
            if len(self.found) >= MAX_CODE_LOOKUPS:
                raise ManifestError(
                    f"the manifest holds more than {MAX_CODE_LOOKUPS} distinct names shaped like import paths "
                    "(`name.attr`); a manifest names files and fields, not code"
                )
            self.found[top] = _importable(top)
        return self.found[top]


def _check_no_code(value: Any, where: str, lookups: _Lookups | None = None) -> None:
    """Refuse strings shaped like an import path of an importable module (`os.system`, `builtins:eval`)."""
    lookups = lookups if lookups is not None else _Lookups()
    if isinstance(value, dict):
        for key, item in value.items():
            _check_no_code(item, f"{where}.{key}", lookups)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_no_code(item, f"{where}[{i}]", lookups)
    elif isinstance(value, str) and ("." in value or ":" in value) and _IMPORT_PATH.match(value):
        if value.rsplit(".", 1)[-1] in _FILE_SUFFIXES:
            return  # `model.onnx` is a file name, even where a module `model` happens to be importable
        top = re.split(r"[.:]", value, maxsplit=1)[0]
        if lookups.importable(top):
            raise ManifestError(
                f"{where} is {value!r}, the name of Python code; a manifest holds data, and loading never "
                "imports or calls what it names"
            )


def _check_type(value: Any, types: tuple[type, ...], where: str) -> None:
    # bool is an int in Python: a `true` where a number belongs is still a schema error.
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        names = " or ".join("null" if t is type(None) else t.__name__ for t in types)
        raise ManifestError(f"{where} must be {names}, got {type(value).__name__}")


def _check_names(values: list[Any], where: str) -> None:
    for i, item in enumerate(values):
        if not isinstance(item, str):
            raise ManifestError(f"{where}[{i}] must be a string, got {type(item).__name__}")


def _config_fields(export_format: str) -> set[str] | None:
    import dataclasses

    from hfexport.auto import AUTO_CONFIG_MAPPING

    cls = AUTO_CONFIG_MAPPING.get(export_format)
    if cls is None or not dataclasses.is_dataclass(cls):
        return None
    return {f.name for f in dataclasses.fields(cls)} | {"export_format"}


def _check_config(config: dict[str, Any] | None, export_format: str, where: str, lookups: _Lookups) -> None:
    if config is None:
        return
    fields = _config_fields(export_format)
    if fields is not None:
        unknown = sorted(set(config) - fields)
        if unknown:
            raise ManifestError(f"{where} has key(s) {unknown} that are not fields of the {export_format} config")
    if config.get("export_format", export_format) != export_format:
        found = config.get("export_format")
        raise ManifestError(f"{where}.export_format is {found!r}, the artifact is {export_format}")
    # `quantizer` records which class quantized the export (its module and name, as a description for people):
    # configs never rebuild it from a dict (`from_dict` drops it), so it is plain data like the report.
    _check_no_code({k: v for k, v in config.items() if k != "quantizer"}, where, lookups)


def _dataclass_keys(cls: Any, required: bool = False) -> set[str]:
    import dataclasses

    fields = dataclasses.fields(cls)
    if required:
        return {f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    return {f.name for f in fields}


def _check_keys(data: Any, cls: Any, where: str) -> None:
    if not isinstance(data, dict):
        raise ManifestError(f"{where} must be an object")
    missing = sorted(_dataclass_keys(cls, required=True) - set(data))
    unknown = sorted(set(data) - _dataclass_keys(cls))
    if missing or unknown:
        raise ManifestError(f"{where}: missing key(s) {missing}, unknown key(s) {unknown} (a {cls.__name__})")


# dtype names a cache leaf may have: `torch.<name>` is a dtype (never any other attribute of torch).
_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"})
_MAX_RANK = 8
_MAX_DIM = 1 << 31
_MAX_IDS = 1 << 20  # token id lists (suppress_tokens can be a large part of a vocabulary)


def _int(value: Any, where: str, low: int, high: int = _MAX_DIM, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        null = " or null" if optional else ""
        raise ManifestError(f"{where} must be an integer in [{low}, {high}]{null}, got {value!r}")


def _bool(value: Any, where: str) -> None:
    if not isinstance(value, bool):
        raise ManifestError(f"{where} must be true or false, got {value!r}")


def _int_list(value: Any, where: str, low: int = 0, cap: int = _MAX_IDS) -> None:
    if not isinstance(value, list) or len(value) > cap:
        raise ManifestError(f"{where} must be a list of at most {cap} integers")
    for i, item in enumerate(value):
        _int(item, f"{where}[{i}]", low)


def _str_list(value: Any, where: str) -> None:
    if not isinstance(value, list) or len(value) > MAX_FILES or not all(isinstance(v, str) for v in value):
        raise ManifestError(f"{where} must be a list of names (strings)")


def _check_leaf(leaf: dict[str, Any], at: str, budget: int) -> None:
    """A cache leaf: a name, a torch dtype name, and a shape of at most `budget` elements (what the files hold)."""
    if not isinstance(leaf["name"], str):
        raise ManifestError(f"{at}.name must be a string")
    if leaf["dtype"] not in _DTYPES:
        raise ManifestError(f"{at}.dtype {leaf['dtype']!r} is not one of {sorted(_DTYPES)}")
    shape = leaf["shape"]
    if not isinstance(shape, list) or len(shape) > _MAX_RANK:
        raise ManifestError(f"{at}.shape must be a list of at most {_MAX_RANK} sizes")
    for i, size in enumerate(shape):
        _int(size, f"{at}.shape[{i}]", 0)
    if math.prod(shape) > budget:
        raise ManifestError(
            f"{at}.shape {shape} has {math.prod(shape)} elements, more than the artifact's files hold ({budget} "
            "bytes): a sample cache is never larger than the model"
        )


def _check_positions(positions: Any, where: str) -> None:
    """`MultimodalPositions.to_dict()`: exactly its keys and its blocks' keys, with values of their types."""
    if positions is None:
        return
    from hfexport.core.positions import MultimodalPositions, PositionBlock

    _check_keys(positions, MultimodalPositions, where)
    if positions["type_key"] is not None and not isinstance(positions["type_key"], str):
        raise ManifestError(f"{where}.type_key must be a string or null")
    _int_list(positions["token_ids"], f"{where}.token_ids")
    _bool(positions["text_row"], f"{where}.text_row")
    _int(positions.get("decode_rows"), f"{where}.decode_rows", 1, _MAX_RANK, optional=True)
    blocks = positions.get("blocks", [])
    if not isinstance(blocks, list) or len(blocks) > MAX_FILES:
        raise ManifestError(f"{where}.blocks must be a list")
    for i, block in enumerate(blocks):
        at = f"{where}.blocks[{i}]"
        _check_keys(block, PositionBlock, at)
        _int(block["token_type"], f"{at}.token_type", 0)
        _int(block["advance"], f"{at}.advance", -_MAX_DIM, optional=True)
        for key, kind in (("offsets", int), ("absolute", bool)):
            rows = block.get(key, [])
            if not isinstance(rows, list) or not all(
                isinstance(row, list) and all(type(v) is kind for v in row) for row in rows
            ):
                raise ManifestError(f"{at}.{key} must be a list of lists of {kind.__name__}")


def _check_generation(
    spec: dict[str, Any] | None, components: dict[str, Any], lookups: _Lookups, budget: int = _MAX_DIM
) -> None:
    """The generation layout (`GenerationSpec.to_dict()`): exactly the keys of its dataclasses, and every value
    of its type and within bounds (a cache leaf no larger than `budget` elements), so that `load` refuses what
    would otherwise fail, or allocate without bound, inside `generate()`."""
    if spec is None:
        return
    from hfexport.generation_spec import LAYOUT_MAX_NUMEL, CacheLeaf, ComponentSpec, GenerationSpec

    where = "manifest.generation"
    _check_keys(spec, GenerationSpec, where)
    if not isinstance(spec["components"], dict) or set(spec["components"]) - set(components):
        raise ManifestError(f"{where}.components must describe components of this artifact")
    for name, comp in spec["components"].items():
        at = f"{where}.components[{name!r}]"
        _check_keys(comp, ComponentSpec, at)
        if not isinstance(comp["inputs"], list) or not isinstance(comp["constants"], dict):
            raise ManifestError(f"{at}: inputs is a list, constants an object")
        _str_list(comp["inputs"], f"{at}.inputs")
        if any(isinstance(v, (dict, list)) for v in comp["constants"].values()):
            raise ManifestError(f"{at}.constants holds scalars only")
        _int(comp["mask_rank"], f"{at}.mask_rank", 0, _MAX_RANK, optional=True)
        layout = comp.get("layout", {})
        if not isinstance(layout, dict) or any(_count_values(v) > LAYOUT_MAX_NUMEL * 3 for v in layout.values()):
            raise ManifestError(f"{at}.layout holds small integer tensors (at most {LAYOUT_MAX_NUMEL} values each)")
        nested = comp.get("leaves", {})
        if not isinstance(nested, dict) or len(nested) > MAX_FILES:
            raise ManifestError(f"{at}.leaves must be an object of name lists")
        for kwarg, names in nested.items():
            _str_list(names, f"{at}.leaves[{kwarg!r}]")
        if not isinstance(comp["cache_leaves"], list) or len(comp["cache_leaves"]) > MAX_FILES:
            raise ManifestError(f"{at}.cache_leaves must be a list")
        for i, leaf in enumerate(comp["cache_leaves"]):
            _check_keys(leaf, CacheLeaf, f"{at}.cache_leaves[{i}]")
            _check_leaf(leaf, f"{at}.cache_leaves[{i}]", budget)
    if spec["cache_key"] is not None and not isinstance(spec["cache_key"], str):
        raise ManifestError(f"{where}.cache_key must be a string or null")
    flags = ("static_cache", "multi_token_decode", "is_encoder_decoder", "mask_current_only", "decode_full_sequence")
    for key in flags:
        if key in spec:
            _bool(spec[key], f"{where}.{key}")
    _int(spec["max_cache_len"], f"{where}.max_cache_len", 1, optional=True)
    _int(spec["sample_batch"], f"{where}.sample_batch", 1)
    for key in ("pad_token_id", "decoder_start_token_id", "forced_bos_token_id"):
        _int(spec.get(key), f"{where}.{key}", 0, optional=True)
    for key in ("eos_token_id", "forced_eos_token_id", "suppress_tokens", "begin_suppress_tokens"):
        _int_list(spec.get(key, []), f"{where}.{key}")
    _str_list(spec.get("encoder_output_fields", []), f"{where}.encoder_output_fields")
    _check_positions(spec.get("positions"), f"{where}.positions")
    _check_no_code(spec, where, lookups)


def check_manifest(manifest: Any) -> dict[str, Any]:
    """Validate a manifest (parsed JSON) against the schema; return it, or raise `ManifestError`."""
    if not isinstance(manifest, dict):
        raise ManifestError(f"a manifest is a JSON object, got {type(manifest).__name__}")
    missing = [k for k in _REQUIRED if k not in manifest]
    if missing:
        raise ManifestError(f"the manifest misses required key(s) {missing}")
    unknown = sorted(set(manifest) - set(_TOP_KEYS))
    if unknown:
        raise ManifestError(f"the manifest has unknown key(s) {unknown}; known: {sorted(_TOP_KEYS)}")
    for key, value in manifest.items():
        _check_type(value, _TOP_KEYS[key], f"manifest.{key}")
    # Counts first: everything after this does work per value, per file or per component.
    if _count_values(manifest) > MAX_VALUES:
        raise ManifestError(f"the manifest holds more than {MAX_VALUES} values; a manifest is small plain data")
    for key, cap in (("files", MAX_FILES), ("components", MAX_COMPONENTS)):
        if len(manifest[key]) > cap:
            raise ManifestError(f"manifest.{key} lists {len(manifest[key])} entries, more than the {cap} allowed")
    lookups = _Lookups()
    _check_plain(manifest, "manifest")
    version = manifest["manifest_version"]
    if version != MANIFEST_VERSION:
        raise ManifestError(
            f"manifest_version {version} is not supported (this hfexport reads version {MANIFEST_VERSION})"
        )
    export_format = manifest["format"]
    if export_format not in FORMATS:
        raise ManifestError(f"manifest.format {export_format!r} is not one of {list(FORMATS)}")

    files = manifest["files"]
    for i, path in enumerate(files):
        check_path(path, f"manifest.files[{i}]")
    if len(set(files)) != len(files):
        raise ManifestError("manifest.files lists a file twice")
    checksums = manifest["checksums"]
    if set(checksums) != set(files):
        raise ManifestError("manifest.checksums must have exactly one entry per file in manifest.files")
    for path, entry in checksums.items():
        if (
            not isinstance(entry, dict)
            or set(entry) != {"size", "sha256"}
            or not isinstance(entry["size"], int)
            or isinstance(entry["size"], bool)
            or entry["size"] < 0
            or not isinstance(entry["sha256"], str)
            or not _SHA256.match(entry["sha256"])
        ):
            raise ManifestError(f"manifest.checksums[{path!r}] must be {{'size': int >= 0, 'sha256': 64 hex digits}}")

    components = manifest["components"]
    if not components:
        raise ManifestError("manifest.components is empty")
    for name, comp in components.items():
        where = f"manifest.components[{name!r}]"
        if not COMPONENT_NAME.match(name) or name in (".", ".."):
            raise ManifestError(f"{where}: the component name is not a plain folder name")
        if not isinstance(comp, dict):
            raise ManifestError(f"{where} must be an object, got {type(comp).__name__}")
        missing = [k for k in _COMPONENT_REQUIRED if k not in comp]
        if missing:
            raise ManifestError(f"{where} misses required key(s) {missing}")
        unknown = sorted(set(comp) - set(_COMPONENT_KEYS))
        if unknown:
            raise ManifestError(f"{where} has unknown key(s) {unknown}; known: {sorted(_COMPONENT_KEYS)}")
        for key, value in comp.items():
            _check_type(value, _COMPONENT_KEYS[key], f"{where}.{key}")
        if comp["format"] != export_format:
            raise ManifestError(f"{where}.format {comp['format']!r} differs from manifest.format {export_format!r}")
        for i, path in enumerate(comp["files"]):
            check_path(path, f"{where}.files[{i}]")
            if path not in checksums:
                raise ManifestError(f"{where}.files[{i}] {path!r} is not in manifest.files")
        main = check_path(comp["main"], f"{where}.main")
        if main not in comp["files"]:
            raise ManifestError(f"{where}.main {main!r} is not one of its files")
        if PurePosixPath(main).suffix != PurePosixPath(MAIN_FILE[export_format]).suffix:
            raise ManifestError(f"{where}.main {main!r} is not a {PurePosixPath(MAIN_FILE[export_format]).suffix}")
        kind = ARTIFACT_FORMATS[export_format]
        if "method" in comp and not kind.methods:
            raise ManifestError(f"{where}.method: a {export_format} file holds one program, it has no methods")
        if "method" in comp and not COMPONENT_NAME.match(comp["method"]):
            raise ManifestError(f"{where}.method {comp['method'][:200]!r} is not a plain name (letters, digits, _ . -)")
        for suffix, what in kind.required_siblings.items():
            sibling = PurePosixPath(main).with_suffix(suffix)
            shared = kind.shared_siblings.get(suffix)
            alternative = str(PurePosixPath(main).parent / shared) if shared is not None else None
            if str(sibling) not in comp["files"] and alternative not in comp["files"]:
                other = f" (nor {alternative}, which the graphs of a generation artifact share)" if alternative else ""
                raise ManifestError(f"{where}: {what} {sibling} are not listed{other}")
        _check_names(comp["inputs"], f"{where}.inputs")
        _check_names(comp["outputs"], f"{where}.outputs")
        _check_config(comp.get("config"), export_format, f"{where}.config", lookups)
    _check_config(manifest.get("config"), export_format, "manifest.config", lookups)
    for key in ("inputs", "outputs"):
        if key in manifest:
            _check_names(manifest[key], f"manifest.{key}")
    for key in ("versions",):
        for name, value in manifest[key].items() if key in manifest else ():
            if not isinstance(value, str):
                raise ManifestError(f"manifest.{key}[{name!r}] must be a string")
    for key in ("model", "model_class", "model_type", "metadata"):
        _check_no_code(manifest.get(key), f"manifest.{key}", lookups)
    # A sample cache is never larger than the model: its elements are bounded by the bytes the files hold.
    budget = sum(entry["size"] for entry in checksums.values())
    _check_generation(manifest.get("generation"), components, lookups, budget)
    return manifest


def read_manifest(directory: str | Path) -> dict[str, Any]:
    """Read and validate `directory/manifest.json` (schema only; files are checked by `load`)."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not directory.is_dir():
        raise ArtifactError(f"{directory} is not a folder")
    if not path.is_file():
        raise ArtifactError(f"{directory} has no {MANIFEST}: not an hfexport artifact (or an unfinished one)")
    if path.is_symlink() and not is_inside(path, directory):
        raise UnsafePathError(f"{path} is a symlink out of the artifact folder")
    size = path.stat().st_size
    if not size <= MAX_MANIFEST_BYTES:
        raise ManifestError(f"{path} is {size} bytes; a manifest is at most {MAX_MANIFEST_BYTES}")
    with open(path, "rb") as f:  # read(n) allocates n bytes up front: read what the stat said, and one more
        raw = f.read(size + 1)
    if len(raw) > size:
        raise ManifestError(f"{path} grew while it was read (a manifest is at most {MAX_MANIFEST_BYTES} bytes)")
    try:
        manifest = json.loads(raw.decode("utf-8"), parse_constant=_refuse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as exc:
        raise ManifestError(f"{path} is not valid JSON: {type(exc).__name__}: {exc}"[:500]) from None
    return check_manifest(manifest)


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def check_files(directory: Path, manifest: dict[str, Any], verify: bool) -> None:
    """Every listed file inside the folder, present, of its recorded size, and (`verify`) of its sha256."""
    # Every path, presence and size first (no file is read), then the hashes: a bad entry anywhere is
    # refused before any byte of any model file is read.
    for rel, expected in manifest["checksums"].items():
        path = directory / rel
        if not is_inside(path, directory):
            raise UnsafePathError(f"{rel!r} leads outside {directory} (through a symlink)")
        if not path.is_file():
            raise ArtifactError(f"{directory} misses {rel!r}, which its manifest lists (an incomplete copy?)")
        size = path.stat().st_size
        if size != expected["size"]:
            raise ArtifactError(
                f"{rel!r} is {size} bytes, the manifest says {expected['size']}: a truncated or replaced file"
            )
    if verify:
        for rel, expected in manifest["checksums"].items():
            if digest(directory / rel)["sha256"] != expected["sha256"]:
                raise ArtifactError(f"{rel!r} does not match its sha256 in the manifest: a corrupt or replaced file")


def update_manifest(directory: str | Path, **fields: Any) -> dict[str, Any]:
    """Set top-level manifest fields (`validation`, `metadata`) of a saved artifact, atomically.

    The new manifest goes through the same checks as a loaded one, then replaces the old file in one
    rename, so a reader sees the old manifest or the new one, never half of one.
    """
    directory = Path(directory)
    allowed = {"validation", "metadata"}
    if set(fields) - allowed:
        raise ValueError(f"update_manifest sets only {sorted(allowed)}, got {sorted(fields)}")
    manifest = read_manifest(directory)
    manifest.update({k: to_plain(v) for k, v in fields.items()})
    check_manifest(manifest)
    write_text_atomically(directory / MANIFEST, json.dumps(manifest, indent=2))
    return manifest


def validation_verdict(manifest: Mapping[str, Any]) -> tuple[str, str]:
    """What the manifest says of the artifact's validation: ("passed" | "failed" | "not run", one line of detail).

    Read from plain manifest data, any shape tolerated: a single export's comparison (outputs, other shapes),
    a generation export's token check, a low-memory export's checks, or the error of a validation that could
    not run.
    """
    record = manifest.get("validation")
    if not isinstance(record, Mapping):
        return "not run", "exported without --validate"
    if record.get("error"):
        return "failed", f"the validation could not run: {record['error']}"
    if record.get("ok") is not True:
        return "failed", _failures(record) or "the artifact differs from eager"
    if "agreement" in record:
        return "passed", f"{record.get('new_tokens')} greedy tokens equal model.generate's"
    shapes = [s.get("name") for s in record.get("shapes") or [] if isinstance(s, Mapping) and not s.get("skipped")]
    tolerance = f"atol {record.get('atol')}, rtol {record.get('rtol')}"
    where = f"the sample and {', '.join(map(str, shapes))}" if shapes else "the sample"
    return "passed", f"matches eager on {where} ({tolerance})"


def _failures(record: Mapping[str, Any]) -> str:
    """The failed checks of a validation record, named: outputs of the sample, other shapes, tokens."""
    failed = [
        f"{o.get('name')}" for o in record.get("outputs") or [] if isinstance(o, Mapping) and o.get("ok") is False
    ]
    failed += [
        f"{s.get('name')} ({s.get('problem') or 'differs'})"
        for s in record.get("shapes") or []
        if isinstance(s, Mapping) and s.get("ok") is False
    ]
    if "agreement" in record:
        agreement = record.get("agreement")
        share = f"{agreement:.0%}" if isinstance(agreement, int | float) else "?"
        failed.append(f"greedy tokens: {share} agree with model.generate")
    return "differs on " + ", ".join(failed) if failed else ""
