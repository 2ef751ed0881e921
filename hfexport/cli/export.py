"""`hfexport export`: export a model, save the artifact with its manifest, and (`--validate`) run it against eager."""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import logging
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hfexport.backends.registry import backend
from hfexport.cli import accuracy as quantized
from hfexport.cli.exits import ExitCode, UsageError, debug_enabled
from hfexport.cli.failure import failure_lines, without_partial_graphs
from hfexport.cli.models import (
    GENERATION_TASKS,
    export_config,
    inputs_source,
    load_empty_model,
    load_model,
    other_samples,
)
from hfexport.cli.progress import Progress
from hfexport.cli.validation import check_generation, conclude, crashed, validation_tolerance
from hfexport.core.files import interrupts_deferred
from hfexport.formats import MAIN_FILE


def _stage_times(report: Any) -> str:
    return ", ".join(f"{stage} {seconds:.1f}s" for stage, seconds in report.stage_seconds.items())


def check_writable(output: Path) -> None:
    """Refuse, before any work, an output folder that cannot be created or written."""
    existing = next((p for p in (output, *output.parents) if p.exists()), Path.cwd())
    if not existing.is_dir():
        raise UsageError(f"--output {output}: {existing} is a file, not a folder")
    # A probe folder, created and removed where the output will go: permissions alone do not show a read-only
    # or pseudo file system (root may write everywhere the mode bits say).
    try:
        probe = tempfile.mkdtemp(prefix=".hfexport-probe-", dir=existing)
    except OSError as exc:
        raise UsageError(f"--output {output}: cannot create a folder in {existing} ({exc.strerror})") from None
    os.rmdir(probe)


def check_file_target(flag: str, path: Path, output: Path | None = None) -> None:
    """Refuse, before any work, a file to write whose folder does not exist or that is a folder itself (a file
    in the `--output` folder is fine: the save creates that folder first)."""
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a folder; name a file, e.g. {path / 'report.html'}")
    parent = path.parent
    if output is not None and parent.resolve() == output.resolve():
        return
    if not parent.is_dir():
        raise UsageError(f"{flag} {path}: the folder {parent} does not exist")


def hf_files(spec: str, model: Any) -> dict[str, bytes]:
    """The Hugging Face files saved beside the export: a folder model's own (config, generation config, tokenizer,
    processor files, copied byte for byte), and what the model object adds (a built-in's config and generation
    config; a folder without generation_config.json gets the one transformers derived from its config)."""
    from hfexport.artifacts.hf_files import collect
    from hfexport.tiny import TINY_MODELS

    files = collect(model=model, files=None if spec in TINY_MODELS else Path(spec))
    return {**files, **_exported_architecture(files.get("config.json"), model)}


def _exported_architecture(config: bytes | None, model: Any) -> dict[str, bytes]:
    """A folder's `config.json` naming the class that was exported in `architectures` (after `--task`, a
    `BertModel` checkpoint exported as `BertForSequenceClassification`), as `save_pretrained` of that model would:
    `AutoExportedModel` and transformers' pipelines read it. {} when it already does (the file stays byte for
    byte) or is not a JSON object."""
    if config is None:
        return {}
    try:
        data = json.loads(config)
    except ValueError:
        return {}
    exported = [type(model).__name__]
    if not isinstance(data, dict) or data.get("architectures") == exported:
        return {}
    return {"config.json": (json.dumps({**data, "architectures": exported}, indent=2, sort_keys=True) + "\n").encode()}


def auto_low_memory(args: argparse.Namespace) -> bool:
    """Whether an export without `--low-memory`/`--no-low-memory` streams its weights: a folder model whose
    checkpoint takes more than half the available memory, exported to ONNX or OpenVINO as one graph; said on
    stderr. Other formats and options cannot stream: they load the model as before."""
    from hfexport.core.checkpoints import low_memory_reason
    from hfexport.tiny import TINY_MODELS

    streams = backend(args.format).streams_weights
    if not streams or args.generation or args.quantize or args.model in TINY_MODELS:
        return False
    if not Path(args.model).is_dir():
        return False
    reason = low_memory_reason(args.model)
    if reason is None:
        return False
    print(
        f"note: {reason}: exporting with --low-memory (weights streamed from the checkpoint; --no-low-memory "
        "loads the model instead)",
        file=sys.stderr,
    )
    return True


def model_options(args: argparse.Namespace) -> dict[str, Any]:
    """The `load_model` options the export flags give."""
    return {
        "dtype": args.dtype,
        "batch_size": args.batch_size,
        "sequence_length": args.sequence_length,
        "trust_remote_code": args.trust_remote_code,
    }


def _manifest_bytes(output: Path) -> bytes | None:
    try:
        return (output / "manifest.json").read_bytes()
    except OSError:
        return None


@contextlib.contextmanager
def nothing_left_on_interrupt(output: Path, reports: list[Path]) -> Iterator[None]:
    """Ctrl-C in the block: remove the artifact the command published in `output` before the interruption.

    An interrupted export leaves no folder that looks finished: its validation, report and "done" never came
    (docs/cli.md, exit 130: "nothing half-written is left"). Only what this command wrote goes: the artifact
    whose manifest differs from the one `output` held before (an `--overwrite` interrupted before its publish
    keeps the previous artifact): its manifest first (so what is left at any moment is no artifact, never a
    manifest without some of its files), the files it lists, the report files this command created in it;
    then the folders left empty, `output` itself when this command created it. A second Ctrl-C during the
    removal is held back until it is done.
    """
    existed = output.exists()
    before = _manifest_bytes(output)
    new_reports = [path for path in reports if not path.exists()]
    try:
        yield
    except KeyboardInterrupt:
        # Another Ctrl-C during the removal waits until it is done: never a manifest with some of its files.
        with interrupts_deferred():
            if _manifest_bytes(output) not in (None, before):
                _remove_artifact(output, new_reports, remove_folder=not existed)
        raise


def _remove_artifact(output: Path, reports: list[Path], remove_folder: bool) -> None:
    try:
        listed = json.loads((output / "manifest.json").read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # not a manifest this command wrote whole: nothing is removed
    root = output.resolve()
    # The manifest first: from then on the folder is no artifact (`load` refuses it), whatever stops the rest.
    for path in [output / "manifest.json", *(output / str(rel) for rel in listed), *reports]:
        resolved = path.resolve()
        if resolved != root and resolved.is_relative_to(root) and resolved.is_file():
            resolved.unlink()
    folders = sorted((p for p in root.rglob("*") if p.is_dir() and not p.is_symlink()), key=lambda p: -len(p.parts))
    for folder in [*folders, *([root] if remove_folder else [])]:
        with contextlib.suppress(OSError):  # not empty: a file this command did not write stays
            folder.rmdir()
    print(f"removed the unfinished artifact in {output}/", file=sys.stderr)


def cmd_export(args: argparse.Namespace) -> int:
    output = Path(args.output)
    reports = [Path(path) for path in (args.report_html, args.report_markdown) if path]
    with nothing_left_on_interrupt(output, reports):
        return _export(args)


def _export(args: argparse.Namespace) -> int:
    from hfexport.artifacts import ArtifactExistsError, check_destination, save, update_manifest
    from hfexport.auto import AutoHfExporter
    from hfexport.core.errors import HfExportError
    from hfexport.rewrites.engine import stage_listener

    output = Path(args.output)
    try:
        # Before minutes of export: a destination the save would refuse is refused now.
        check_destination(output, args.overwrite)
    except ArtifactExistsError as exc:
        raise UsageError(str(exc)) from None
    if getattr(args, "low_memory", None) is None:
        args.low_memory = auto_low_memory(args)
    config = export_config(args)
    progress = Progress()
    try:
        start = progress.step(f"building {args.model}")
        auto_class = None
        if args.low_memory:
            model, inputs, auto_class = load_empty_model(args.model, args.task, **model_options(args))
        else:
            model, inputs = load_model(args.model, args.task, **model_options(args))
        exporter = AutoHfExporter.from_config(config)
        if args.generation:
            return _export_generation(args, model, inputs, exporter, config, progress, start)
        progress.step(f"exporting {type(model).__name__} to {args.format} (dynamic={config.dynamic})")
        try:
            with stage_listener(progress.stage), without_partial_graphs(_debug(args)):
                program = exporter.export(model, inputs, config=config)
        except HfExportError as exc:
            progress.close()
            if exporter.report is not None:
                print(exporter.report.table(all_rules=args.all))
                write_report_files(args, exporter.report)  # what ran before the failure, for a browser too
            _say_failed(args, exc)
            return int(ExitCode.EXPORT_FAILED)
        report = exporter.report
        progress.step(
            f"exported in {report.total_seconds:.1f}s ({_stage_times(report)}); {len(report.fired)} rule(s) fired"
        )
        t0 = progress.step(f"saving {args.format} artifact to {output}/")
        save(
            program,
            output,
            overwrite=args.overwrite,
            config=_as_used(config, [report]),
            report=report,
            model=args.model,
            hf_files=hf_files(args.model, model),
            metadata=_sample_record(args, inputs),
        )
        progress.step(f"saved in {time.perf_counter() - t0:.1f}s")

        status = 0
        validation = None
        if args.validate:
            try:
                if args.low_memory:
                    validation, text = _validate_low_memory(args, model, inputs, config, auto_class, output, progress)
                else:
                    validation, text = _validate(args, model, inputs, config, report, output, progress)
            except Exception as exc:  # the check could not run: a failed validation, never success
                validation, text = crashed(exc), ""
                debug_exc = exc
            else:
                debug_exc = None
            update_manifest(output, validation=validation)
            progress.close()
            if text:
                print(text)
            status = conclude(output, validation, debug_exc if _debug(args) else None)
    finally:
        progress.close()
    print(report.table(all_rules=args.all))
    write_report_files(args, report, validation)
    print(f"{'done' if status == 0 else 'FAILED'} in {time.perf_counter() - start:.1f}s: {output}")
    return status


def write_report_files(args: argparse.Namespace, reports: Any, validation: dict[str, Any] | None = None) -> None:
    """`--report-html` / `--report-markdown`: the report (or `{component: report}`) and validation as files."""
    targets = [("html", args.report_html), ("markdown", args.report_markdown)]
    if not any(path for _, path in targets):
        return
    from hfexport.apps.render import export_document, write_documents

    for path in write_documents(export_document(reports, validation, model=args.model), targets):
        print(f"report written to {path}", file=sys.stderr)


def _validate(
    args: argparse.Namespace,
    model: Any,
    inputs: dict[str, Any],
    config: Any,
    report: Any,
    output: Path,
    progress: Progress,
) -> tuple[dict[str, Any], str]:
    """`--validate`: the saved artifact loaded back and run in its runtime (on `--device`) against eager, on the
    traced sample and, for a dynamic export, on inputs of other shapes (a shape eager itself refuses is a skipped
    check with eager's reason). Returns the manifest's record and what to print."""
    from hfexport.artifacts.validation import validate_export
    from hfexport.runtime.devices import resolve_device, use_device

    device = resolve_device(args.format, args.device) if args.device else None
    tolerance = validation_tolerance(args, config, model)
    where = f" on {device.name}" if device else ""
    progress.step(f"validating {MAIN_FILE[args.format]} in the {args.format} runtime{where} against eager")
    # Other shapes too: a baked length or batch shows up here, not at the user's first other input.
    others = other_samples(args.model, inputs, task=args.task, **model_options(args)) if config.dynamic else {}
    if not config.dynamic:
        progress.step("static export (--no-dynamic): only the traced shape is checked")
    with use_device(device):
        # trust: the .pt2 is the one this process wrote a moment ago.
        validation = validate_export(
            output,
            model,
            inputs,
            atol=tolerance.atol,
            rtol=tolerance.rtol,
            other_inputs=others,
            used=report.used,
            trust=True,
        )
        accuracy = quantized.measure(args, model, output, inputs, config)
    validation.tolerance_source = tolerance.source
    report.parity = validation.max_abs_diff
    record = {**validation.to_dict(), "device": device.name if device else "cpu"}
    if accuracy is None:
        return record, str(validation)
    # A quantized export differs from eager by design: it must run on every input, and its accuracy against the
    # float model decides, not the tolerance.
    report.accuracy = accuracy
    ok = quantized.runs_everywhere(validation) and accuracy.ok
    record.update(ok=ok, tolerance_ok=validation.ok, accuracy=accuracy.to_dict())
    lines = ["(quantized: its outputs differ from eager by design; the accuracy below decides)", str(validation)]
    return record, "\n".join(lines + quantized.accuracy_lines(accuracy))


def _sample_record(args: argparse.Namespace, inputs: dict[str, Any]) -> dict[str, Any]:
    """The manifest's `metadata.sample_inputs`: where the traced sample came from and its inputs' shapes."""
    shapes = {k: list(v.shape) for k, v in inputs.items() if hasattr(v, "shape")}
    return {"sample_inputs": {"source": inputs_source(args.model, args.task), "shapes": shapes}}


def _as_used(config: Any, reports: list[Any]) -> Any:
    """The config the manifest records: where it left the ONNX opset open (None: the newest), the opset the
    export wrote (the report's `used["opset"]`), so the manifest never says null for something it knows."""
    opsets = {r.used.get("opset") for r in reports if r is not None and r.used.get("opset")}
    if getattr(config, "opset_version", 0) is not None or len(opsets) != 1:
        return config
    recorded = copy.copy(config)
    recorded.opset_version = opsets.pop()
    return recorded


def _say_failed(args: argparse.Namespace, exc: Exception) -> None:
    """A failed export in a few lines (stage, the model's line, next steps); the whole error with `--debug`."""
    if _debug(args):
        print(f"error: export failed: {exc}", file=sys.stderr)
        return
    for line in failure_lines(exc, args.model, args.format):
        print(line, file=sys.stderr)


def _debug(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "debug", False)) or debug_enabled([])


def _validate_low_memory(
    args: argparse.Namespace,
    model: Any,
    inputs: dict[str, Any],
    config: Any,
    auto_class: str | None,
    output: Path,
    progress: Progress,
) -> tuple[dict[str, Any], str]:
    """`--low-memory --validate` (`hfexport.artifacts.low_memory.validate_low_memory`). Returns the manifest's record
    and what to print."""
    import torch

    from hfexport.artifacts.low_memory import validate_low_memory

    tolerance = validation_tolerance(args, config, model)
    others = other_samples(args.model, inputs, task=args.task, **model_options(args)) if config.dynamic else {}
    checked = validate_low_memory(
        output,
        args.model,
        inputs,
        config,
        layers=args.check_layers or 2,
        auto_class=auto_class or "AutoModelForCausalLM",
        dtype=getattr(torch, args.dtype) if args.dtype else None,
        atol=tolerance.atol,
        rtol=tolerance.rtol,
        trust_remote_code=args.trust_remote_code,
        other_inputs=others,
        progress=progress.step,
    )
    return {**checked.to_dict(), "tolerance_source": tolerance.source}, str(checked)


# hfexport's warning for a size-1 sample axis (`frontends.torch_export.size_one_axis_warnings`).
_SIZE_ONE = "has size 1 on axis"


class _HoldSizeOne(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return _SIZE_ONE not in record.getMessage()


@contextlib.contextmanager
def _step_sizes_held() -> Iterator[None]:
    """While generation components export: their size-1 axes are not warned about on stderr as they come
    (`_step_sizes_as_notes` says them once, as what they are)."""
    log = logging.getLogger("hfexport")
    held = _HoldSizeOne()
    log.addFilter(held)
    try:
        yield
    finally:
        log.removeFilter(held)


def _step_sizes_as_notes(reports: dict[str, Any]) -> None:
    """A generation component's size-1 axes are the step `generate` ran (a decode step's one token, Whisper's
    decoder start token): not a sample to retrace with a larger size, as the warning of a single export advises,
    but what that graph takes. Each becomes a note of its report saying so."""
    for name, report in reports.items():
        held = [w for w in report.warnings if _SIZE_ONE in w]
        if not held:
            continue
        report.warnings = [w for w in report.warnings if _SIZE_ONE not in w]
        axes = "; ".join(w.split(" in the sample")[0] for w in held)
        report.notes.append(
            f"{axes} in the call generate made to {name}: that axis is static, the size this step takes "
            "(--multi-token-decode exports a decode step that takes any number of tokens)"
        )


def _generation_config(args: argparse.Namespace) -> Any:
    """`--static-cache N`: a static cache of N slots (None: generate's default, a growing cache)."""
    if not args.static_cache:
        return None
    from transformers import GenerationConfig

    return GenerationConfig(cache_implementation="static", max_cache_len=args.static_cache)


def _export_generation(
    args: argparse.Namespace,
    model: Any,
    inputs: dict[str, Any],
    exporter: Any,
    config: Any,
    progress: Progress,
    start: float,
) -> int:
    """`export --generation`: every component `generate` runs, saved as one artifact of several components.

    `--validate` loads the saved artifact (every component must open and run on the inputs recorded for it)
    and compares `--new-tokens` greedy tokens of the exported components with `model.generate`.
    """
    from hfexport.artifacts import save, update_manifest
    from hfexport.core.errors import HfExportError
    from hfexport.rewrites.engine import stage_listener

    why = f" (--task {args.task}: what generate runs, as --generation)" if args.task in GENERATION_TASKS else ""
    progress.step(f"exporting the generation components of {type(model).__name__} to {args.format}{why}")
    try:
        with stage_listener(progress.stage), without_partial_graphs(_debug(args)), _step_sizes_held():
            programs = exporter.export_for_generation(
                model,
                inputs,
                config,
                generation_config=_generation_config(args),
                multi_token_decode=args.multi_token_decode,
            )
    except HfExportError as exc:
        progress.close()
        for report in getattr(exporter, "reports", {}).values():
            print(report.table(all_rules=args.all))
        if getattr(exporter, "reports", None):
            write_report_files(args, exporter.reports)
        _say_failed(args, exc)
        return int(ExitCode.EXPORT_FAILED)
    reports = exporter.reports
    _step_sizes_as_notes(reports)
    for name, report in reports.items():
        progress.step(f"{name}: exported in {report.total_seconds:.1f}s; {len(report.fired)} rule(s) fired")
    # The programs generate() runs besides the documented components (a VLM's features and prefill) are saved too.
    names = [*programs, *getattr(programs, "runtime_components", {})]
    t0 = progress.step(f"saving {len(names)} components ({', '.join(names)}) to {args.output}/")
    save(
        programs,
        args.output,
        overwrite=args.overwrite,
        config=_as_used(config, list(reports.values())),
        report=reports,
        model=args.model,
        hf_files=hf_files(args.model, model),
        metadata=_sample_record(args, inputs),
    )
    progress.step(f"saved in {time.perf_counter() - t0:.1f}s")
    status = 0
    validation: dict[str, Any] | None = None
    if args.validate:
        try:
            validation, lines = check_generation(
                Path(args.output),
                model,
                inputs,
                programs,
                _generation_config(args),
                args.new_tokens or 8,
                progress.step,
            )
            accuracy = quantized.measure(args, model, Path(args.output), inputs, config)
            if accuracy is not None:  # a quantized export: the accuracy gates it, not token equality
                validation.update(ok=all(validation["components_run"].values()) and accuracy.ok)
                validation["accuracy"] = accuracy.to_dict()
                for report in reports.values():
                    report.accuracy = accuracy
                lines += quantized.accuracy_lines(accuracy)
        except Exception as exc:  # the check could not run: a failed validation, never success
            validation, lines, debug_exc = crashed(exc), [], exc
        else:
            debug_exc = None
        update_manifest(args.output, validation=validation)
        progress.close()
        for line in lines:
            print(line)
        status = conclude(Path(args.output), validation, debug_exc if _debug(args) else None)
    progress.close()
    for report in reports.values():
        print(report.table(all_rules=args.all))
    write_report_files(args, reports, validation)
    print(f"{'done' if status == 0 else 'FAILED'} in {time.perf_counter() - start:.1f}s: {args.output}")
    return status
