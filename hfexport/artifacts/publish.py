"""Save an export into a folder, all or nothing: each component's files, then the manifest, then one rename.

    hfexport.save(exported, "out/", config=config, report=exporter.report)   # one native object
    hfexport.save({"prefill": ep1, "decode": ep2}, "out/")                  # one per component

A single export keeps its files at the top of the folder (`model.onnx`, `model.onnx.data`, `report.json`,
`manifest.json`); a dict of components gives each its own subfolder (`decode/model.pte`). Each component is
written by its format's entry of `hfexport.artifacts.formats.ARTIFACT_FORMATS`. A generation artifact stores each
weight once: a component that is the same program as another (prefill served by decode) lists that one's files,
and a format with `write_components` writes the distinct graphs beside one weights file (ONNX: `prefill.onnx`,
`decode.onnx`, `weights.data`) or into one program with a method per component (ExecuTorch: `model.pte`, its
methods `prefill` and `decode`, which the manifest names); each component's report stays in its subfolder.
Everything is written into a temporary folder beside the destination, flushed, then renamed into place
(`hfexport.core.files.replace_folder`: an existing artifact is swapped out in one `renameat2(RENAME_EXCHANGE)` where the
filesystem has it). A save killed at any point leaves the destination absent or the previous artifact whole; the
next save into the same place removes the dead save's temporary folder.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import secrets
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from hfexport._version import __version__
from hfexport.artifacts.errors import ArtifactError, ArtifactExistsError
from hfexport.artifacts.formats import ARTIFACT_FORMATS
from hfexport.artifacts.hf_files import collect
from hfexport.artifacts.manifest import (
    COMPONENT_NAME,
    MANIFEST,
    MANIFEST_VERSION,
    REPORT,
    SINGLE,
    check_manifest,
    read_manifest,
    to_plain,
)
from hfexport.core.files import digest, fsync, is_inside, remove_dead_temporaries, replace_folder, temporary_beside
from hfexport.formats import MAIN_FILE, format_of

Progress = Callable[[str], None]
logger = logging.getLogger("hfexport")


def export_format_of(program: Any) -> str:
    """The format of a native export object (`hfexport.formats.format_of`), or `TypeError` naming what save takes."""
    try:
        return format_of(program)
    except TypeError:
        cls = type(program)
        raise TypeError(
            f"cannot save a {cls.__module__}.{cls.__name__}: save takes what an exporter returned (ExportedProgram, "
            "ONNXProgram, ExecutorchProgramManager, openvino.Model) or a dict of component name -> one of those"
        ) from None


def _write_component(program: Any, export_format: str, folder: Path, config: Any) -> list[Path]:
    """Write one component into `folder`; return its files, the one to load first."""
    folder.mkdir(parents=True, exist_ok=True)
    main = folder / MAIN_FILE[export_format]
    ARTIFACT_FORMATS[export_format].write(program, main, config)
    side = sorted(p for p in folder.iterdir() if p.is_file() and p.name.startswith("model.") and p != main)
    return [main, *side]


def _write_models(
    programs: Mapping[str, Any],
    export_format: str,
    tmp: Path,
    configs: Mapping[str, Any],
    single: bool,
    together: bool,
    say: Progress,
) -> dict[str, tuple[list[Path], str | None]]:
    """Write the model files of every component; return each component's files (the one to load first at the
    head) and the method of that file it runs (None: the file's only program).

    In a generation artifact (`together`), a component that is the same program as a later one (a prefill served
    by the decode graph: static cache and multi-token decode) is written once, and lists the files of the last of
    them; the distinct programs go to the format's `write_components`, which stores each weight once for all of
    them, where the format has one. Where it writes them into one file (a program with a method per component),
    each component runs the method named by the component whose program it is. Otherwise each component is
    written into its own subfolder.
    """
    if single:
        say(f"saving {export_format} artifact")
        return {SINGLE: (_write_component(programs[SINGLE], export_format, tmp, configs[SINGLE]), None)}
    last = {id(program): name for name, program in programs.items()}
    owner = {name: last[id(program)] if together else name for name, program in programs.items()}
    distinct = {name: program for name, program in programs.items() if owner[name] == name}
    written: dict[str, list[Path]] | None = None
    write_components = ARTIFACT_FORMATS[export_format].write_components
    if together and write_components is not None and len(distinct) > 1:
        say(f"saving {', '.join(distinct)} (each weight once)")
        written = write_components(distinct, tmp, {name: configs[name] for name in distinct})
    if written is None:
        written = {}
        for name, program in distinct.items():
            say(f"saving {name}")
            written[name] = _write_component(program, export_format, tmp / name, configs[name])
    mains = [files[0] for files in written.values()]
    methods = {name: name if mains.count(files[0]) > 1 else None for name, files in written.items()}
    return {name: (written[owner[name]], methods[owner[name]]) for name in programs}


def _not_ours(folder: Path) -> str | None:
    """Why `folder` is not provably an hfexport artifact, or None when it is.

    Provably ours: its manifest parses and validates as an hfexport manifest, and every entry under the
    folder is the manifest, a file the manifest lists, or a folder that holds listed files. A symlink or a
    special file is never one of ours.
    """
    try:
        manifest = read_manifest(folder)
    except ArtifactError as exc:
        return f"its {MANIFEST} is not an hfexport manifest ({' '.join(str(exc).split())[:200]})"
    listed = {*manifest["files"], MANIFEST}
    folders = {str(parent) for path in listed for parent in PurePosixPath(path).parents if str(parent) != "."}
    for entry in _walk(folder, len(listed) + len(folders)):
        rel = entry.relative_to(folder).as_posix()
        if entry.is_symlink() or not (entry.is_file() or entry.is_dir()):
            return f"{rel!r} is a symlink or a special file, which hfexport never writes"
        if rel not in (folders if entry.is_dir() else listed):
            return f"{rel!r} is not listed in its {MANIFEST}"
    return None


def _walk(folder: Path, limit: int) -> Any:
    """Every entry under `folder` (symlinks not followed); stops one past `limit` entries."""
    seen = 0
    stack = [folder]
    while stack:
        for entry in stack.pop().iterdir():
            seen += 1
            yield entry
            if seen > limit:
                return
            if entry.is_dir() and not entry.is_symlink():
                stack.append(entry)


def check_destination(destination: str | Path, overwrite: bool = False) -> Path:
    """Refuse a destination `save` would refuse, before any work: raises `ArtifactExistsError`.

    An absent or empty folder is fine; a non-empty one needs `overwrite=True` and must be provably an
    earlier artifact (a valid hfexport manifest that lists every file there), so that a typo never replaces
    an unrelated folder, and no file the manifest does not list is ever removed.
    """
    destination = Path(destination)
    if destination.is_symlink():
        raise ArtifactExistsError(f"{destination} is a symlink; save into a real folder")
    if destination.exists() and not destination.is_dir():
        raise ArtifactExistsError(f"{destination} exists and is not a folder")
    if destination.is_dir() and any(destination.iterdir()):
        if not overwrite:
            raise ArtifactExistsError(
                f"{destination} exists and is not empty; pass overwrite=True (--overwrite) to replace the "
                "artifact there"
            )
        problem = _not_ours(destination)
        if problem is not None:
            raise ArtifactExistsError(
                f"{destination} is not an hfexport artifact: {problem}. Refusing to replace it even with "
                "overwrite: choose a new or empty folder (or move the files that are not the artifact's)"
            )
    return destination


def _discard_previous(previous: Path, destination: Path) -> None:
    """Remove the replaced artifact: only its manifest and the files it lists, then its empty folders.

    Whatever else is there (a file written into the old folder after it was checked) is kept, in a folder
    beside the destination named `<name>.hfexport-kept-*`, and a warning names it.
    """
    try:
        manifest = read_manifest(previous)
        listed = [*manifest["files"], MANIFEST]
    except ArtifactError:
        listed = []
    for rel in listed:
        path = previous / rel
        # Never through a symlinked folder: only files that are really inside the old folder go.
        if path.is_file() and not path.is_symlink() and is_inside(path, previous):
            path.unlink()
    for folder in sorted((p for p in previous.rglob("*") if p.is_dir() and not p.is_symlink()), reverse=True):
        with contextlib.suppress(OSError):
            folder.rmdir()
    with contextlib.suppress(OSError):
        previous.rmdir()
    if previous.exists():
        kept = destination.parent / f"{destination.name}.hfexport-kept-{secrets.token_hex(4)}"
        os.rename(previous, kept)
        logger.warning("%s: files not listed by the replaced artifact's manifest were kept in %s", destination, kept)


def _publish(tmp: Path, destination: Path, overwrite: bool) -> Path | None:
    # Checked again at the end: the destination may have been filled while the export was being written.
    check_destination(destination, overwrite)
    return replace_folder(tmp, destination)


def _per_component(value: Any, names: list[str], what: str) -> dict[str, Any]:
    """A single value for every component, or a dict that must name only known components."""
    if isinstance(value, Mapping) and not hasattr(value, "to_dict"):
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise ValueError(f"{what} names unknown component(s) {unknown}; components: {names}")
        return {n: value.get(n) for n in names}
    return dict.fromkeys(names, value)


def save(
    result: Any,
    directory: str | Path,
    *,
    overwrite: bool = False,
    config: Any = None,
    report: Any = None,
    model: Any = None,
    validation: Mapping[str, Any] | None = None,
    metadata: Mapping[str, Any] | None = None,
    progress: Progress | None = None,
    tokenizer: Any = None,
    processor: Any = None,
    hf_files: Mapping[str, bytes] | str | Path | None = None,
    weights_once: bool = True,
) -> Path:
    """Save an export (a native object, or a dict of component name -> native object) into `directory`.

    `config` and `report` (an `ExportReport`) are recorded in the manifest; either may be a dict per
    component. `metadata` is free plain data (no import paths). `model` is the model's name, or the
    `PreTrainedModel` itself: then its `config.json` and `generation_config.json` are written beside the export
    (and its `name_or_path` recorded). `tokenizer` / `processor` write their `save_pretrained` files, and
    `hf_files` (a model folder, or {file name: bytes}) adds Hugging Face files copied from there
    (`hfexport.artifacts.hf_files`), so the folder loads with `AutoConfig` / `AutoTokenizer.from_pretrained`.
    Every one of them is listed in the manifest with its size and sha256. A generation export stores each weight
    once (see the module docstring); `weights_once=False` writes every component into its own subfolder with its
    own weights, as earlier hfexport versions did. Returns the folder. Raises
    `ArtifactExistsError` when `directory` holds something and `overwrite` is false (nothing is written),
    `TypeError` for an object no exporter returns.
    """
    destination = check_destination(directory, overwrite)
    model_object = model if model is not None and not isinstance(model, str) else None
    if model_object is not None:
        model = getattr(getattr(model_object, "config", None), "name_or_path", None) or None
    extra_files = collect(model=model_object, tokenizer=tokenizer, processor=processor, files=hf_files)
    say = progress or (lambda _message: None)
    single = not isinstance(result, Mapping)
    programs: dict[str, Any] = {SINGLE: result} if single else dict(result)
    # export_for_generation keeps the programs its runtime needs beyond the documented components beside the
    # dict: saved as components too, so a loaded artifact generates (the manifest's generation layout names them).
    runtime = {} if single else dict(getattr(result, "runtime_components", None) or {})
    documented = list(programs)
    programs.update(runtime)
    if not programs:
        raise ValueError("nothing to save: the dict of components is empty")
    for name in programs:
        if not isinstance(name, str) or not COMPONENT_NAME.match(name) or name in (".", ".."):
            raise ValueError(f"component name {name!r} is not a plain folder name (letters, digits, _ . -)")
    formats = {name: export_format_of(p) for name, p in programs.items()}
    if len(set(formats.values())) != 1:
        raise ValueError(f"the components of one export share a format, got {formats}")
    export_format = next(iter(formats.values()))
    names = list(programs)
    configs = _per_component(config, names, "config")
    if runtime:
        from hfexport.frontends.generation import runtime_config_source

        # A config dict names the documented components; a runtime component was exported with its source's.
        for name in runtime:
            if configs[name] is None:
                configs[name] = configs.get(runtime_config_source(name, documented))
    # A dict of configs (one per component) goes into each component; one config is recorded once, at the top.
    config_per_component = isinstance(config, Mapping) and not hasattr(config, "to_dict")
    reports = _per_component(report, names, "report")

    destination.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_temporaries(destination)
    tmp = temporary_beside(destination)
    tmp.mkdir()
    previous: Path | None = None
    try:
        components: dict[str, Any] = {}
        files: list[str] = []
        together = weights_once and getattr(result, "spec", None) is not None  # an export_for_generation result
        model_files = _write_models(programs, export_format, tmp, configs, single, together, say)
        for name, program in programs.items():
            folder = tmp if single else tmp / name
            model_paths, method = model_files[name]
            written = list(model_paths)
            comp_report = reports[name]
            if comp_report is not None and hasattr(comp_report, "save"):
                folder.mkdir(parents=True, exist_ok=True)
                written.append(comp_report.save(folder / REPORT))
            rel = [p.relative_to(tmp).as_posix() for p in written]
            inputs, outputs = ARTIFACT_FORMATS[export_format].signature(program)
            components[name] = {
                "format": export_format,
                "main": rel[0],
                "files": rel,
                "inputs": inputs,
                "outputs": outputs,
                "config": to_plain(configs[name]) if config_per_component else None,
                "report": to_plain(comp_report) if not single else None,
            }
            if method is not None:
                components[name]["method"] = method
            files += [path for path in rel if path not in files]  # files shared by components are listed once
        for name, data in extra_files.items():
            if name == MANIFEST or (tmp / name).exists():
                raise ValueError(f"the Hugging Face file {name!r} would replace a file or folder of the export")
            (tmp / name).write_bytes(data)
            files.append(name)
        for path in files:
            fsync(tmp / path)
        shared_config = None if config_per_component else config
        manifest = {
            "manifest_version": MANIFEST_VERSION,
            "format": export_format,
            "components": components,
            "files": files,
            "checksums": {path: digest(tmp / path) for path in files},
            "model": model,
            "model_class": _first(reports, "model_class"),
            "model_type": _first(reports, "model_type"),
            "versions": _versions(reports),
            "config": to_plain(shared_config),
            "report": to_plain(reports[SINGLE]) if single else None,
            "validation": to_plain(validation) if validation is not None else None,
            "metadata": to_plain(metadata) if metadata is not None else None,
            # export_for_generation's layout (components' inputs, constants, cache leaves): how to drive them.
            "generation": to_plain(spec.to_dict()) if (spec := getattr(result, "spec", None)) is not None else None,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        }
        if single:
            # The signature at the top too, for readers of a one-model artifact.
            manifest["inputs"], manifest["outputs"] = components[SINGLE]["inputs"], components[SINGLE]["outputs"]
        check_manifest(manifest)  # what we write, we must be able to load
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
        fsync(tmp / MANIFEST)
        fsync(tmp)
        say(f"publishing {destination}")
        previous = _publish(tmp, destination, overwrite)
    finally:
        # Before the publish `tmp` is this save's own staging; after an exchange it holds the previous artifact.
        if previous is None and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if previous is not None:
        _discard_previous(previous, destination)
    return destination


def _first(reports: Mapping[str, Any], attr: str) -> str | None:
    """`attr` of the model the artifact exports: a generation export's first components may be submodules
    (Whisper's `WhisperEncoder`, LLaVA's vision tower), its `decode` step runs the model itself."""
    ordered = [reports["decode"], *reports.values()] if reports.get("decode") is not None else reports.values()
    return next((getattr(r, attr) for r in ordered if getattr(r, attr, None)), None)


def _versions(reports: Mapping[str, Any]) -> dict[str, str]:
    versions: dict[str, str] = {}
    for r in reports.values():
        versions.update({str(k): str(v) for k, v in (getattr(r, "versions", None) or {}).items()})
    if not versions:
        from hfexport.core.versions import installed_version

        for name in ("torch", "transformers"):
            found = installed_version(name)
            if found:
                versions[name] = found
    versions.setdefault("hfexport", __version__)
    return versions
