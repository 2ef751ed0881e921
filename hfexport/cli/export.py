"""`hfexport export`: export a model, save the artifact with its manifest, and (`--validate`) run it against eager."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from hfexport.backends.registry import backend
from hfexport.cli import accuracy as quantized
from hfexport.cli.exits import ExitCode, UsageError
from hfexport.cli.export_config import export_config
from hfexport.cli.export_generation import export_generation
from hfexport.cli.export_output import nothing_left_on_interrupt
from hfexport.cli.export_records import save_with_records, write_report_files
from hfexport.cli.failure import debugging, say_failed, without_partial_graphs
from hfexport.cli.models import (
    load_empty_model,
    load_model,
    other_samples,
)
from hfexport.cli.progress import Progress
from hfexport.cli.validation import conclude, crashed, validation_tolerance
from hfexport.formats import MAIN_FILE


def _stage_times(report: Any) -> str:
    return ", ".join(f"{stage} {seconds:.1f}s" for stage, seconds in report.stage_seconds.items())


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


def cmd_export(args: argparse.Namespace) -> int:
    output = Path(args.output)
    reports = [Path(path) for path in (args.report_html, args.report_markdown) if path]
    with nothing_left_on_interrupt(output, reports):
        return _export(args)


def _export(args: argparse.Namespace) -> int:
    from hfexport.artifacts import ArtifactExistsError, check_destination, update_manifest
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
            return export_generation(args, model, inputs, exporter, config, progress, start)
        progress.step(f"exporting {type(model).__name__} to {args.format} (dynamic={config.dynamic})")
        try:
            with stage_listener(progress.stage), without_partial_graphs(debugging(args)):
                program = exporter.export(model, inputs, config=config)
        except HfExportError as exc:
            progress.close()
            if exporter.report is not None:
                print(exporter.report.table(all_rules=args.all))
                write_report_files(args, exporter.report)  # what ran before the failure, for a browser too
            say_failed(args, exc)
            return int(ExitCode.EXPORT_FAILED)
        report = exporter.report
        progress.step(
            f"exported in {report.total_seconds:.1f}s ({_stage_times(report)}); {len(report.fired)} rule(s) fired"
        )
        t0 = progress.step(f"saving {args.format} artifact to {output}/")
        save_with_records(args, program, output, config, report, model, inputs)
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
            status = conclude(output, validation, debug_exc if debugging(args) else None)
    finally:
        progress.close()
    print(report.table(all_rules=args.all))
    write_report_files(args, report, validation)
    print(f"{'done' if status == 0 else 'FAILED'} in {time.perf_counter() - start:.1f}s: {output}")
    return status


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
