"""The manifest of a saved export: its schema, the checks that refuse anything else, reading and updating it.

The manifest is data, never code. `check_manifest` refuses, before any model file is opened: a manifest that
is not a JSON object of the documented schema (unknown keys included), a file path that is absolute or has
`..`, a config key that is not a field of the format's config, and a string in the config or metadata
shaped like an import path of an importable module (`os.system`), and a generation layout whose values are not of
their types and bounds. Sizes and counts (`MAX_MANIFEST_BYTES`, `MAX_COMPONENTS`, and `manifest_values`'
`MAX_VALUES`, `MAX_FILES`, `MAX_CODE_LOOKUPS`) are capped before any per-name work. The checks of values (plain data,
no code) live in `manifest_values.py`, the check of the generation layout in `manifest_generation.py`.
`check_files` then refuses a listed file that escapes the folder through a symlink, is missing, or whose size or
sha256 differs from the manifest.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from hfexport.artifacts.errors import ArtifactError, ManifestError, UnsafePathError
from hfexport.artifacts.formats import ARTIFACT_FORMATS
from hfexport.artifacts.manifest_generation import check_generation
from hfexport.artifacts.manifest_values import (
    MAX_FILES,
    MAX_VALUES,
    Lookups,
    check_no_code,
    check_plain,
    check_type,
    count_values,
)
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
MAX_COMPONENTS = 1_000
COMPONENT_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


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


def _check_config(config: dict[str, Any] | None, export_format: str, where: str, lookups: Lookups) -> None:
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
    check_no_code({k: v for k, v in config.items() if k != "quantizer"}, where, lookups)


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
        check_type(value, _TOP_KEYS[key], f"manifest.{key}")
    # Counts first: everything after this does work per value, per file or per component.
    if count_values(manifest) > MAX_VALUES:
        raise ManifestError(f"the manifest holds more than {MAX_VALUES} values; a manifest is small plain data")
    for key, cap in (("files", MAX_FILES), ("components", MAX_COMPONENTS)):
        if len(manifest[key]) > cap:
            raise ManifestError(f"manifest.{key} lists {len(manifest[key])} entries, more than the {cap} allowed")
    lookups = Lookups()
    check_plain(manifest, "manifest")
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
            check_type(value, _COMPONENT_KEYS[key], f"{where}.{key}")
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
        check_no_code(manifest.get(key), f"manifest.{key}", lookups)
    # A sample cache is never larger than the model: its elements are bounded by the bytes the files hold.
    budget = sum(entry["size"] for entry in checksums.values())
    check_generation(manifest.get("generation"), components, lookups, budget)
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
