"""The `hfexport` command (also `python -m hfexport`).

hfexport export --model tiny-llama --format onnx --output out/ --validate
hfexport audit --model tiny-qwen3-moe --format onnx [--json audit.json] [--explain] [--ablate [ID ...]]
hfexport rules list [--stage fx] [--backend onnx]
hfexport rules show patch/moe-grouped-mm-portable
hfexport scan [--models llama,qwen2] [--path file_or_folder] [--json scan.json]
hfexport sweep --configs tests/fixtures/corpus/causal_lm --format onnx [--html h.html] [--png h.png] [--csv F]
hfexport check out/ [--trust]

Progress goes to stderr (live per stage with rich on a terminal, plain lines otherwise), results to stdout.
Exit codes: 0 success; 1 the artifact differs from eager beyond the tolerance (or an audited export failed);
2 the export failed.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path
from typing import Any

from hfexport.rewrites.rule import BACKENDS, STAGES

FORMATS = BACKENDS


# --task -> the transformers Auto class a local model folder is loaded with.
TASKS: dict[str, str] = {
    "causal-lm": "AutoModelForCausalLM",
    "seq2seq-lm": "AutoModelForSeq2SeqLM",
    "feature-extraction": "AutoModel",
    "sequence-classification": "AutoModelForSequenceClassification",
    "masked-lm": "AutoModelForMaskedLM",
}


def _task_class(path: Path, task: str) -> Any:
    """The Auto class for `task`; `auto` reads the folder's config (`architectures`) to choose."""
    import transformers

    if task == "auto":
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        architecture = (getattr(config, "architectures", None) or [""])[0]
        suffixes = {
            "ForCausalLM": "causal-lm",
            "ForConditionalGeneration": "seq2seq-lm",
            "ForSequenceClassification": "sequence-classification",
            "ForMaskedLM": "masked-lm",
        }
        task = next((t for suffix, t in suffixes.items() if architecture.endswith(suffix)), "feature-extraction")
    return getattr(transformers, TASKS[task])


def _load_model(spec: str, task: str = "auto") -> tuple[Any, dict[str, Any]]:
    from hfexport.tiny import TINY_MODELS

    if spec in TINY_MODELS:
        tiny = TINY_MODELS[spec]
        return tiny.build(), tiny.sample_inputs()
    path = Path(spec)
    if not path.is_dir():
        raise SystemExit(f"--model {spec!r} is neither a built-in ({', '.join(TINY_MODELS)}) nor a local model folder")
    import torch
    from transformers import AutoTokenizer

    model = _task_class(path, task).from_pretrained(path, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    inputs = tokenizer(["Hello, world!", "Export me"], padding=True, return_tensors="pt")
    return model, {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}


class Progress:
    """Progress on stderr: `step` for a new phase, `stage` for a pipeline stage entered during an export.

    On a terminal with rich installed, a spinner names the running stage and each finished stage is printed
    with its time; otherwise (a pipe, a log, no rich) one plain line per step and per stage.
    """

    def __init__(self, live: bool | None = None) -> None:
        self.console: Any = None
        self.status: Any = None
        self.current: tuple[str, float] | None = None
        if live is None:
            live = sys.stderr.isatty()
        if live:
            try:
                from rich.console import Console

                self.console = Console(stderr=True)
            except ImportError:
                self.console = None

    def step(self, message: str) -> float:
        self._finish_stage()
        self._stop_status()
        if self.console is not None:
            self.console.print(f"• {message}", highlight=False)
        else:
            print(f"• {message}", file=sys.stderr, flush=True)
        return time.perf_counter()

    def stage(self, name: str) -> None:
        self._finish_stage()
        self.current = (name, time.perf_counter())
        if self.console is not None:
            if self.status is None:
                self.status = self.console.status(f"stage {name}")
                self.status.start()
            else:
                self.status.update(f"stage {name}")
        else:
            print(f"  › stage {name}", file=sys.stderr, flush=True)

    def _finish_stage(self) -> None:
        if self.current is None:
            return
        name, start = self.current
        self.current = None
        if self.console is not None:
            self.console.print(f"  ✓ {name} {time.perf_counter() - start:.1f}s", highlight=False)

    def _stop_status(self) -> None:
        if self.status is not None:
            self.status.stop()
            self.status = None

    def close(self) -> None:
        self._finish_stage()
        self._stop_status()


_PROGRESS = Progress(live=False)


def _step(message: str) -> float:
    return _PROGRESS.step(message)


def _split(values: list[str] | None) -> tuple[str, ...]:
    """`--disable a,b --disable c` -> ("a", "b", "c")."""
    return tuple(v.strip() for value in values or () for v in value.split(",") if v.strip())


def _config(args: argparse.Namespace) -> Any:
    from hfexport.auto import AutoExportConfig

    data: dict[str, Any] = {"export_format": args.format, "dynamic": args.dynamic}
    if args.config:
        text = Path(args.config[1:]).read_text() if args.config.startswith("@") else args.config
        extra = json.loads(text)
        if not isinstance(extra, dict):
            raise SystemExit("--config takes a JSON object, e.g. '{\"compress_to_fp16\": false}'")
        data.update(extra)
    if args.enable or args.disable:
        data["rules"] = {"enable": list(_split(args.enable)), "disable": list(_split(args.disable))}
    config = AutoExportConfig.from_dict(data)
    if args.quantize:
        config.quantizer = _quantizer(args.quantize, args.format)
    from hfexport.rewrites.engine import default_registry

    default_registry().validate_selection(config.rules)
    return config


QUANTIZE_RECIPES = ("ort-dynamic", "ort-static", "pt2e-x86", "nncf-int8", "nncf-int4")


def _quantizer(recipe: str, export_format: str) -> Any:
    """The quantizer of a `--quantize` recipe for a format (the export checks the pair before tracing)."""
    from hfexport import quantizers as q

    if recipe == "ort-dynamic":
        return q.OnnxRuntimeQuantizer(q.OnnxRuntimeDynamicConfig())
    if recipe == "ort-static":
        return q.OnnxRuntimeQuantizer(q.OnnxRuntimeStaticConfig())
    if recipe == "pt2e-x86":
        from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
            X86InductorQuantizer,
            get_default_x86_inductor_quantization_config,
        )

        return q.PT2EQuantizer(X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config()))
    nncf = {"onnx": q.NNCFOnnxQuantizer, "openvino": q.NNCFOpenVINOQuantizer}.get(export_format, q.NNCFTorchFXQuantizer)
    if recipe == "nncf-int8":
        return nncf(q.NNCFQuantizationConfig())
    if recipe == "nncf-int4":
        return nncf(q.NNCFWeightCompressionConfig(mode="int4_sym", group_size=32))
    raise SystemExit(f"--quantize {recipe!r}: choose one of {', '.join(QUANTIZE_RECIPES)}")


def _default_rtol(config: Any) -> float:
    # fp16 weights (OpenVINO's save default) are within ~1e-3 of f32 relative to the output's scale.
    return 1e-2 if getattr(config, "compress_to_fp16", False) else 1e-3


def _stage_times(report: Any) -> str:
    return ", ".join(f"{stage} {seconds:.1f}s" for stage, seconds in report.stage_seconds.items())


def cmd_export(args: argparse.Namespace) -> int:
    from hfexport.artifacts import validate
    from hfexport.auto import AutoHfExporter
    from hfexport.errors import HfExportError
    from hfexport.rewrites.engine import stage_listener
    from hfexport.saving import ArtifactExistsError, check_destination, save, update_manifest

    output = Path(args.output)
    try:
        # Before minutes of export: a destination the save would refuse is refused now.
        check_destination(output, args.overwrite)
    except ArtifactExistsError as exc:
        raise SystemExit(str(exc)) from None
    config = _config(args)
    progress = Progress()
    try:
        start = progress.step(f"building {args.model}")
        model, inputs = _load_model(args.model, args.task)
        exporter = AutoHfExporter.from_config(config)
        if args.generation:
            return _export_generation(args, model, inputs, exporter, config, progress, start)
        progress.step(f"exporting {type(model).__name__} to {args.format} (dynamic={config.dynamic})")
        try:
            with stage_listener(progress.stage):
                program = exporter.export(model, inputs, config=config)
        except HfExportError as exc:
            progress.close()
            if exporter.report is not None:
                print(exporter.report)
            print(f"export failed: {exc}", file=sys.stderr)
            return 2
        report = exporter.report
        progress.step(
            f"exported in {report.total_seconds:.1f}s ({_stage_times(report)}); {len(report.fired)} rule(s) fired"
        )
        t0 = progress.step(f"saving {args.format} artifact to {output}/")
        save(program, output, overwrite=args.overwrite, config=config, report=report, model=args.model)
        progress.step(f"saved in {time.perf_counter() - t0:.1f}s")

        status = 0
        if args.validate:
            rtol = args.rtol if args.rtol is not None else _default_rtol(config)
            from hfexport.saving import MAIN_FILE

            progress.step(f"validating {MAIN_FILE[args.format]} in the {args.format} runtime against eager")
            # trust: the .pt2 is the one this process wrote a moment ago.
            validation = validate(output, model, inputs, atol=args.atol, rtol=rtol, trust=True)
            report.parity = validation.max_abs_diff
            update_manifest(output, validation=validation.to_dict())
            print(validation)
            if not validation.ok:
                print("validation failed: the artifact differs from eager beyond the tolerance", file=sys.stderr)
                status = 1
    finally:
        progress.close()
    print(report)
    print(f"{'done' if status == 0 else 'FAILED'} in {time.perf_counter() - start:.1f}s: {output}")
    return status


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
    import torch

    from hfexport.errors import HfExportError
    from hfexport.rewrites.engine import stage_listener
    from hfexport.saving import load, save, update_manifest

    progress.step(f"exporting the generation components of {type(model).__name__} to {args.format}")
    try:
        with stage_listener(progress.stage):
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
            print(report)
        print(f"export failed: {exc}", file=sys.stderr)
        return 2
    reports = exporter.reports
    for name, report in reports.items():
        progress.step(f"{name}: exported in {report.total_seconds:.1f}s; {len(report.fired)} rule(s) fired")
    t0 = progress.step(f"saving {len(programs)} components ({', '.join(programs)}) to {args.output}/")
    save(programs, args.output, overwrite=args.overwrite, config=config, report=reports, model=args.model)
    progress.step(f"saved in {time.perf_counter() - t0:.1f}s")
    status = 0
    if args.validate:
        from hfexport.runtime.generation import generate

        progress.step("validating: each saved component loads and runs on its recorded inputs")
        loaded = load(args.output, trust=True)  # written by this process a moment ago
        ran = {}
        for name in loaded.components:
            outputs = loaded.run(programs.samples[name], name)
            ran[name] = all(bool(torch.isfinite(t).all()) for t in outputs.values() if t.is_floating_point())
        ids, mask = inputs["input_ids"], inputs.get("attention_mask")
        n = args.new_tokens
        progress.step(f"validating: {n} greedy tokens of the exported components against model.generate")
        reference = _generation_config(args) or copy.deepcopy(model.generation_config)
        reference.max_new_tokens = reference.min_new_tokens = n
        reference.do_sample = False
        with torch.no_grad():  # the same cache kind as the export
            want = model.generate(input_ids=ids, attention_mask=mask, generation_config=reference)
        got = generate(programs, ids, mask, max_new_tokens=n, min_new_tokens=n)
        prompt = ids.shape[1]
        same = got.shape == want.shape and torch.equal(got[:, prompt:], want[:, prompt:])
        agreement = float((got[:, prompt:] == want[:, prompt:]).float().mean()) if got.shape == want.shape else 0.0
        validation = {"ok": same and all(ran.values()), "components_run": ran, "new_tokens": n, "agreement": agreement}
        update_manifest(args.output, validation=validation)
        print(f"components run from the saved artifact: {ran}")
        print(f"greedy tokens vs model.generate: {agreement:.0%} of {n} x {ids.shape[0]} agree")
        if not validation["ok"]:
            print("validation failed: the generated tokens differ from model.generate", file=sys.stderr)
            status = 1
    progress.close()
    for report in reports.values():
        print(report)
    print(f"{'done' if status == 0 else 'FAILED'} in {time.perf_counter() - start:.1f}s: {args.output}")
    return status


def cmd_audit(args: argparse.Namespace) -> int:
    from hfexport.audit import run_audit

    config = _config(args)
    _step(f"building {args.model}")
    model, inputs = _load_model(args.model, args.task)
    ablate: bool | tuple[str, ...] = False
    if args.ablate is not None:
        ablate = _split(args.ablate) or True
    rtol = args.rtol if args.rtol is not None else 1e-3
    audit = run_audit(
        model,
        inputs,
        config,
        model_name=args.model,
        ablate=ablate,
        atol=args.atol,
        rtol=rtol,
        progress=lambda message: _step(message),
    )
    print(audit.render(explain=args.explain))
    if args.json:
        audit.save(args.json)
        _step(f"wrote {args.json}")
    return 0 if audit.exported and (audit.validation or {}).get("ok") else 1


def cmd_rules_list(args: argparse.Namespace) -> int:
    from hfexport.rewrites.engine import default_registry

    rules = [r for r in default_registry().rules(args.stage) if args.backend is None or args.backend in r.meta.backends]
    for rule in rules:
        meta = rule.meta
        expires = f" [expires {meta.expires}]" if meta.expires else ""
        print(f"{meta.id:45s} {meta.kind:12s} {','.join(meta.backends):30s} {meta.why}{expires}")
    print(f"{len(rules)} rule(s)")
    return 0


def cmd_rules_show(args: argparse.Namespace) -> int:
    from hfexport.audit import expiry_status, rule_diff, rule_location, rule_sources, rule_target
    from hfexport.rewrites.engine import default_registry

    try:
        rule = default_registry().get(args.id)
    except KeyError as exc:
        raise SystemExit(str(exc.args[0])) from None
    meta = rule.meta
    expired, expiry = expiry_status(meta)
    expiry_text = "never (no expiry set)"
    if meta.expires:
        expiry_text = f"{meta.expires}: " + ("EXPIRED, " if expired else "") + expiry
    print(f"{meta.id}  ({type(rule).__name__}, stage {rule.stage}, kind {meta.kind})")
    location = rule_location(rule)
    upstream = meta.upstream_ref
    fields = [
        ("defined", str(location) if location else "-"),
        ("why", meta.why),
        ("upstream", meta.upstream or "-"),
        ("expires", expiry_text),
        ("backends", ", ".join(meta.backends)),
        ("models", ", ".join(meta.models) or "-"),
        ("default", "on" if meta.enabled_by_default else "off (enable it with RuleSelection(enable=...))"),
        ("target", rule_target(rule) or "-"),
    ]
    if upstream is not None and upstream.kind == "package":
        # A pin says which release the rule was written against; the installed one may have moved on.
        from hfexport.versions import installed_version

        installed = installed_version(upstream.package) or "not installed"
        fields.insert(3, ("", f"(written against {upstream.package} {upstream.version}; installed: {installed})"))
    for name, value in fields:
        print(f"{name + ':' if name else '':10s} {value}")
    print("examples:")
    for example in meta.examples:
        print(f"  {type(example).__name__:8s} {example.description or '(no description)'}")
    diff = rule_diff(rule)
    if diff:
        print("diff (patched source -> replacement):")
        print(diff.rstrip())
    else:
        for name, source in rule_sources(rule).items():
            print(f"{name}:")
            print(source.rstrip())
    return 0


def cmd_scan(args: argparse.Namespace) -> int:
    from hfexport.scan import scan

    models = list(_split(args.models)) or None
    try:
        result = scan(models=models, paths=args.path, progress=lambda message: _step(message), jobs=args.jobs)
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(str(exc)) from None
    print(result)
    if args.json:
        Path(args.json).write_text(result.to_json())
        _step(f"wrote {args.json}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from hfexport.saving import ArtifactError, load

    try:
        loaded = load(args.directory, trust=args.trust)
    except ArtifactError as exc:
        print(f"refused: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    manifest = loaded.manifest
    print(f"{loaded.directory}: {loaded.export_format} artifact of {manifest.get('model_class') or '?'}, ok")
    for name, component in loaded.components.items():
        print(f"  {name}: {component.main}  inputs {component.inputs}  outputs {len(component.outputs)}")
    print(f"  files {len(manifest['files'])} (sizes and sha256 verified), versions {loaded.versions}")
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from hfexport.sweep import find_configs, run_sweep

    if args.png:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            # Refused before the sweep: a PNG that silently never appears after an hour is worse.
            raise SystemExit(
                "--png needs matplotlib, which is not installed (pip install matplotlib); "
                "--html writes the same heatmap as a static page without it"
            ) from None
    extra: dict[str, Any] = {}
    if args.config:
        text = Path(args.config[1:]).read_text() if args.config.startswith("@") else args.config
        extra = json.loads(text)
        if not isinstance(extra, dict):
            raise SystemExit("--config takes a JSON object, e.g. '{\"fusions\": null}'")
    try:
        paths = find_configs(args.configs, _split(args.only) or None)
    except FileNotFoundError as exc:
        raise SystemExit(str(exc)) from None
    _step(f"sweeping {len(paths)} model(s) to {args.format} with {args.jobs} job(s)")
    sweep = run_sweep(
        paths, args.format, config=extra, jobs=args.jobs, timeout=args.timeout, progress=lambda m: _step(m)
    )
    print(sweep.table())
    for path, text in ((args.csv, sweep.to_csv()), (args.json, sweep.to_json()), (args.html, sweep.to_html())):
        if path:
            Path(path).write_text(text)
            _step(f"wrote {path}")
    if args.png:
        sweep.save_png(args.png)
        _step(f"wrote {args.png}")
    return 0


def _export_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="built-in tiny model name or a local model folder")
    parser.add_argument("--format", default="dynamo", help=f"export format: {', '.join(FORMATS)} (default: dynamo)")
    parser.add_argument("--dynamic", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--task",
        default="auto",
        choices=["auto", *TASKS],
        help="for a local model folder: the Auto class to load it with (auto: from its config's architectures)",
    )
    parser.add_argument(
        "--quantize",
        choices=QUANTIZE_RECIPES,
        help="quantize while exporting (ort-*: onnx; nncf-*: onnx/openvino/dynamo; pt2e-x86: dynamo/onnx/openvino)",
    )
    parser.add_argument(
        "--config", help="extra config fields as JSON (or @file.json), e.g. '{\"compress_to_fp16\": false}'"
    )
    parser.add_argument("--enable", action="append", help="enable rules by id or prefix (comma-separated)")
    parser.add_argument("--disable", action="append", help="disable rules by id or prefix (comma-separated)")
    parser.add_argument("--atol", type=float, default=1e-4, help="absolute tolerance against eager (1e-4)")
    parser.add_argument(
        "--rtol",
        type=float,
        default=None,
        help="tolerance relative to each output's largest eager value (1e-3; 1e-2 for fp16-compressed OpenVINO)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hfexport", description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)

    export = sub.add_parser("export", help="export a model, save the artifact with a manifest, optionally validate")
    _export_options(export)
    export.add_argument("--output", required=True, help="folder for the artifact, report and manifest")
    export.add_argument("--validate", action="store_true", help="run the artifact in its runtime against eager")
    export.add_argument("--overwrite", action="store_true", help="replace an earlier artifact in the output folder")
    export.add_argument(
        "--generation",
        action="store_true",
        help="export the components generate() runs (prefill/decode, ...) as one multi-component artifact",
    )
    export.add_argument(
        "--new-tokens", type=int, default=8, help="with --generation --validate: greedy tokens to compare (8)"
    )
    export.add_argument(
        "--static-cache", type=int, metavar="N", help="with --generation: export against a static cache of N slots"
    )
    export.add_argument(
        "--multi-token-decode",
        action="store_true",
        help="with --generation: one decode graph for any number of query tokens (prompt, speculative blocks)",
    )
    export.set_defaults(func=cmd_export)

    audit = sub.add_parser("audit", help="export and report what every rule did; optionally ablate fired rules")
    _export_options(audit)
    audit.add_argument("--json", help="also write the audit as JSON to this file")
    audit.add_argument("--explain", action="store_true", help="say why each rule did or did not fire")
    audit.add_argument(
        "--ablate",
        nargs="*",
        metavar="ID",
        help="re-export with each fired rule (or each ID given) disabled and report whether it is needed",
    )
    audit.set_defaults(func=cmd_audit)

    rules = sub.add_parser("rules", help="the registered rewrite rules")
    rules_sub = rules.add_subparsers(dest="rules_command", required=True)
    listing = rules_sub.add_parser("list", help="one line per rule")
    listing.add_argument("--stage", choices=STAGES)
    listing.add_argument("--backend", choices=BACKENDS)
    listing.set_defaults(func=cmd_rules_list)
    show = rules_sub.add_parser("show", help="a rule's metadata, examples and source diff")
    show.add_argument("id")
    show.set_defaults(func=cmd_rules_show)

    scan = sub.add_parser("scan", help="find export-breaking patterns in transformers' modeling sources")
    scan.add_argument("--models", action="append", help="model types, comma-separated (default: every model)")
    scan.add_argument("--path", action="append", help="scan this file or folder instead (repeatable)")
    scan.add_argument("--json", help="also write the sites as JSON to this file")
    scan.add_argument("--jobs", type=int, default=1, help="parse files in this many processes (default 1)")
    scan.set_defaults(func=cmd_scan)

    check = sub.add_parser("check", help="verify a saved artifact (manifest, paths, checksums) and open it")
    check.add_argument("directory")
    check.add_argument("--trust", action="store_true", help="allow a .pt2 (it deserialises with pickle)")
    check.set_defaults(func=cmd_check)

    sweep = sub.add_parser("sweep", help="export many tiny-config models; write the models x rules hit matrix")
    sweep.add_argument("--configs", required=True, help="a corpus entry (JSON) or a folder searched for them")
    sweep.add_argument("--format", default="dynamo", choices=FORMATS)
    sweep.add_argument("--only", action="append", help="only these entries (file stems, comma-separated)")
    sweep.add_argument("--config", help="extra config fields as JSON (or @file.json) for every export")
    sweep.add_argument("--jobs", type=int, default=1, help="models exported at once, one process each (default 1)")
    sweep.add_argument("--timeout", type=float, default=600, help="seconds per model before it counts as a hang")
    sweep.add_argument("--csv", help="write the hit matrix (one column per rule of the format) as CSV")
    sweep.add_argument("--json", help="write rows, dead and expired rules as JSON")
    sweep.add_argument("--html", help="write the heatmap as a static HTML table")
    sweep.add_argument("--png", help="write the heatmap as a PNG (needs matplotlib)")
    sweep.set_defaults(func=cmd_sweep)
    return parser


def main(argv: list[str] | None = None) -> int:
    from hfexport.errors import ConfigError, InputError, MissingPackageError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, InputError, MissingPackageError) as exc:
        # Refused before any tracing (a config, input or package problem): the message says what to do.
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
