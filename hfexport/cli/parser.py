"""The `hfexport` argument parser and `main`: each subcommand calls its module's `cmd_*` function."""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from typing import NoReturn

from hfexport.apps.bench import BACKENDS as BENCH_BACKENDS
from hfexport.cli.audit import cmd_audit
from hfexport.cli.bench import cmd_bench
from hfexport.cli.check import cmd_check
from hfexport.cli.exits import ExitCode, UsageError, debug_enabled, fail, one_line
from hfexport.cli.export import cmd_export
from hfexport.cli.export_config import QUANTIZE_RECIPES
from hfexport.cli.flag_checks import check_combinations
from hfexport.cli.models import DTYPES, TASK_CHOICES, dtype_name
from hfexport.cli.noise import quiet_third_party
from hfexport.cli.report import cmd_report
from hfexport.cli.rules import cmd_rules_list, cmd_rules_show, cmd_rules_test, register_named_rules
from hfexport.cli.scan import cmd_scan
from hfexport.cli.sweep import LOCAL_RAY, cmd_sweep
from hfexport.formats import FORMATS
from hfexport.rewrites.rule import STAGES

DESCRIPTION = "The `hfexport` command (also `python -m hfexport`)."


class _Parser(argparse.ArgumentParser):
    """argparse that reports a mistake as one line (with a close match for a mistyped choice), not usage + exit."""

    def error(self, message: str) -> NoReturn:
        choice = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            options = re.findall(r"'?([^',]+)'?(?:, |$)", choice.group(2))
            close = difflib.get_close_matches(choice.group(1), [o.strip() for o in options], n=1)
            if close:
                message += f"; did you mean {close[0]!r}?"
        raise UsageError(f"{message} (see `{self.prog} --help`)")


def _debug_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--debug", action="store_true", help="show tracebacks (also HFEXPORT_DEBUG=1)")


def _rules_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--rules",
        action="append",
        metavar="NAME",
        help="also use the rules of this module or hfexport.rules entry point (comma-separated; also HFEXPORT_RULES)",
    )


def _export_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="built-in tiny model name or a local model folder")
    parser.add_argument(
        "--format", default="dynamo", type=str.lower, choices=FORMATS, help="export format (default: dynamo)"
    )
    parser.add_argument("--dynamic", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument(
        "--task",
        default="auto",
        choices=TASK_CHOICES,
        metavar="TASK",
        help="the task (ours or a Hugging Face pipeline name: text-generation, fill-mask, ...); for a local folder "
        "it picks the Auto class (auto: from its config's architectures); a built-in model takes only its own",
    )
    parser.add_argument(
        "--dtype",
        type=dtype_name,
        choices=DTYPES,
        help="load the model in this dtype: float32|fp32, float16|fp16, bfloat16|bf16 (default: the checkpoint's)",
    )
    parser.add_argument("--opset", type=int, help="ONNX opset version (--format onnx)")
    parser.add_argument(
        "--portable",
        action="store_true",
        help="--format onnx: standard ONNX ops only (no com.microsoft fusions), for any ONNX runtime",
    )
    parser.add_argument("--batch-size", type=int, help="batch of the sample inputs the export traces (2)")
    parser.add_argument("--sequence-length", type=int, help="text tokens of the sample inputs (the model's default)")
    parser.add_argument(
        "--trust-remote-code", action="store_true", help="let transformers run the folder's own modeling code"
    )
    parser.add_argument(
        "--quantize",
        choices=QUANTIZE_RECIPES,
        help="quantize while exporting (ort-*: onnx; nncf-*: onnx/openvino/dynamo; pt2e-x86: dynamo/onnx/openvino; "
        "torchao-8da4w: executorch/dynamo)",
    )
    parser.add_argument(
        "--keep-float",
        action="append",
        metavar="MODULES",
        help="with --quantize: modules kept in floating point (mixed precision), comma-separated names, prefixes or "
        "globs, e.g. model.layers.3.mlp,lm_head",
    )
    parser.add_argument(
        "--eval-text",
        metavar="FILE",
        help="with --quantize: the text a quantized export is measured on against the float model (default: "
        "held-out Python stdlib source)",
    )
    parser.add_argument(
        "--config", help="extra config fields as JSON (or @file.json), e.g. '{\"compress_to_fp16\": false}'"
    )
    parser.add_argument("--enable", action="append", help="enable rules by id or prefix (comma-separated)")
    parser.add_argument("--disable", action="append", help="disable rules by id or prefix (comma-separated)")
    parser.add_argument("--atol", type=float, help="with --validate: absolute tolerance against eager (1e-4)")
    parser.add_argument(
        "--rtol",
        type=float,
        default=None,
        help="with --validate: tolerance relative to each output's largest eager value (1e-3 for float32 weights; "
        "larger for float16/bfloat16 ones, docs/cli.md)",
    )


def build_parser() -> argparse.ArgumentParser:
    from hfexport._version import __version__

    parser = _Parser(prog="hfexport", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"hfexport {__version__}")
    _debug_option(parser)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    export = sub.add_parser("export", help="export a model, save the artifact with a manifest, optionally validate")
    _export_options(export)
    export.add_argument("--output", required=True, help="folder for the artifact, report and manifest")
    export.add_argument("--validate", action="store_true", help="run the artifact in its runtime against eager")
    export.add_argument(
        "--max-perplexity-increase",
        type=float,
        metavar="PCT",
        help="with --quantize --validate: fail when perplexity rises more than PCT %% over the float model's "
        "(default: the budget of the recipe's precision, docs/quantization.md)",
    )
    export.add_argument(
        "--device",
        help="where the artifact runs: cpu (default), cuda[:N] (dynamo, onnx; executorch: the CUDA backend), "
        "gpu[.N] (openvino); refused with exit 2 when this machine has no such device",
    )
    export.add_argument(
        "--all", action="store_true", help="list every rule in the printed table, not only those that ran"
    )
    export.add_argument("--report-html", metavar="FILE", help="also write the report (and validation) as static HTML")
    export.add_argument("--report-markdown", metavar="FILE", help="also write the report (and validation) as Markdown")
    export.add_argument("--overwrite", action="store_true", help="replace an earlier artifact in the output folder")
    export.add_argument(
        "--generation",
        action="store_true",
        help="export the components generate() runs (prefill/decode, ...) as one multi-component artifact",
    )
    export.add_argument(
        "--new-tokens", type=int, default=None, help="with --generation --validate: greedy tokens to compare (8)"
    )
    export.add_argument(
        "--static-cache", type=int, metavar="N", help="with --generation: export against a static cache of N slots"
    )
    export.add_argument(
        "--multi-token-decode",
        action="store_true",
        help="with --generation: one decode graph for any number of query tokens (prompt, speculative blocks)",
    )
    export.add_argument(
        "--low-memory",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="--format onnx or openvino, a folder model: capture on weights that hold no memory and stream them "
        "from the safetensors shards into model.onnx.data / model.bin one tensor at a time (docs/low-memory.md). "
        "Default: on when the checkpoint's weights take more than half the available memory (said on stderr)",
    )
    export.add_argument(
        "--check-layers",
        type=int,
        default=None,
        metavar="N",
        help="with --low-memory --validate: compare a reduced export of the first N layers with eager (2)",
    )
    export.set_defaults(func=cmd_export)

    audit = sub.add_parser("audit", help="export and report what every rule did; optionally ablate fired rules")
    _export_options(audit)
    audit.add_argument("--json", help="also write the audit as JSON to this file")
    audit.add_argument("--html", metavar="FILE", help="also write the audit as static HTML")
    audit.add_argument("--markdown", metavar="FILE", help="also write the audit as Markdown")
    audit.add_argument("--explain", action="store_true", help="say why each rule did or did not fire")
    audit.add_argument(
        "--quant",
        action="store_true",
        help="with --quantize: rank the linear groups by the error the recipe adds in each (one export per group, "
        "measured against the float model) and measure keeping the worst in floating point",
    )
    audit.add_argument(
        "--keep-worst", type=int, default=2, metavar="N", help="with --quant: groups kept in float for the gain (2)"
    )
    audit.add_argument(
        "--all", action="store_true", help="list every registered rule, not only those that ran in this export"
    )
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
    listing.add_argument("--backend", choices=FORMATS)
    listing.set_defaults(func=cmd_rules_list)
    show = rules_sub.add_parser("show", help="a rule's metadata, examples and source diff")
    show.add_argument("id")
    show.set_defaults(func=cmd_rules_show)
    test = rules_sub.add_parser("test", help="register a module of rules and check its examples in the real runtimes")
    test.add_argument("module", help="a module that lists rules as RULES, or an hfexport.rules entry point")
    test.add_argument("--all", action="store_true", help="every example on every backend, and each fix's need")
    test.set_defaults(func=cmd_rules_test)

    scan = sub.add_parser("scan", help="find export-breaking patterns in transformers' modeling sources")
    scan.add_argument("--models", action="append", help="model types, comma-separated (default: every model)")
    scan.add_argument("--path", action="append", help="scan this file or folder instead (repeatable)")
    scan.add_argument("--json", help="also write the sites as JSON to this file")
    scan.add_argument("--jobs", type=int, default=1, help="parse files in this many processes (default 1)")
    scan.set_defaults(func=cmd_scan)

    check = sub.add_parser("check", help="verify a saved artifact (manifest, paths, checksums) and open it")
    check.add_argument("directory")
    check.add_argument(
        "--trust", action="store_true", help="allow a format whose files run code when loaded (a .pt2: pickle, C++)"
    )
    check.set_defaults(func=cmd_check)

    report = sub.add_parser("report", help="render a saved artifact's report: verdict, rules that fired, the rest")
    report.add_argument("directory")
    report.add_argument("--html", metavar="FILE", help="write it as a static HTML page")
    report.add_argument("--markdown", metavar="FILE", help="write it as Markdown (without either: on stdout)")
    report.set_defaults(func=cmd_report)

    sweep = sub.add_parser("sweep", help="export many tiny-config models; write the models x rules hit matrix")
    sweep.add_argument("--configs", required=True, help="a corpus entry (JSON) or a folder searched for them")
    sweep.add_argument("--format", default="dynamo", type=str.lower, choices=FORMATS)
    sweep.add_argument("--only", action="append", help="only these entries (file stems, comma-separated)")
    sweep.add_argument("--config", help="extra config fields as JSON (or @file.json) for every export")
    sweep.add_argument(
        "--jobs",
        type=int,
        help="models exported at once, one process each (default 1; with --ray at an address: the cluster's CPUs)",
    )
    sweep.add_argument(
        "--ray",
        nargs="?",
        const=LOCAL_RAY,
        metavar="ADDRESS",
        help="run the models as Ray tasks (pip install 'hfexport[ray]'): alone, on a local cluster of --jobs CPUs; "
        "with `auto`, HOST:PORT or ray://HOST:PORT, on that running cluster",
    )
    sweep.add_argument(
        "--generation",
        action="store_true",
        help="export each model for generation and compare hfexport.runtime.generate's 8 greedy tokens from a "
        "left-padded batch of 2 with the model's own generate (instead of outputs against eager)",
    )
    sweep.add_argument(
        "--static",
        type=int,
        default=0,
        metavar="SLOTS",
        help="with --generation: a static cache of SLOTS slots and one multi-token decode graph",
    )
    sweep.add_argument("--timeout", type=float, default=600, help="seconds per model before it counts as a hang")
    sweep.add_argument("--markdown", help="write one table row per model and the summary as Markdown")
    sweep.add_argument("--csv", help="write the hit matrix (one column per rule of the format) as CSV")
    sweep.add_argument("--json", help="write rows, dead and expired rules as JSON")
    sweep.add_argument("--html", help="write the heatmap as a static HTML table")
    sweep.add_argument("--png", help="write the heatmap as a PNG (needs matplotlib)")
    sweep.set_defaults(func=cmd_sweep)

    bench = sub.add_parser(
        "bench", help="time generation of a causal LM exported to each backend: TTFT, decode tok/s, %% of ceiling"
    )
    bench.add_argument("--model", required=True, help="built-in tiny model name or a local model folder")
    bench.add_argument(
        "--backends",
        action="append",
        help=f"comma-separated: {', '.join(BENCH_BACKENDS)} (default: every format)",
    )
    bench.add_argument("--precisions", action="append", help="comma-separated: fp32, int8, int4 (default fp32)")
    bench.add_argument("--prompt", type=int, default=128, help="prompt tokens (batch 1, random ids; default 128)")
    bench.add_argument("--new", type=int, default=128, help="new tokens generated greedily (default 128)")
    bench.add_argument("--repeats", type=int, default=3, help="timings are medians of this many runs (default 3)")
    bench.add_argument(
        "--dtype", type=dtype_name, choices=DTYPES, help="load the model in this dtype (default: the checkpoint's)"
    )
    bench.add_argument(
        "--bandwidth-mb", type=int, default=512, help="fp32 matrix torch.mv streams to measure bandwidth (512)"
    )
    bench.add_argument(
        "--trust-remote-code", action="store_true", help="let transformers run the folder's own modeling code"
    )
    bench.add_argument("--json", help="also write the rows and the ceiling as JSON to this file")
    bench.set_defaults(func=cmd_bench, backends=None, precisions=None)
    for command in (export, audit, listing, show, test, scan, check, report, sweep, bench):
        _debug_option(command)
    for command in (export, audit, listing, show, sweep):
        _rules_option(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the command; return its exit code (`ExitCode`). Tracebacks only with `--debug`/`HFEXPORT_DEBUG`."""
    from hfexport.core.errors import ConfigError, HfExportError, InputError, MissingPackageError

    debug = debug_enabled(argv)
    try:
        args = build_parser().parse_args(argv)
        quiet_third_party(debug)
        check_combinations(args)
        register_named_rules(getattr(args, "rules", None))
        return args.func(args)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return int(ExitCode.INTERRUPTED)
    except (UsageError, ConfigError, InputError, MissingPackageError) as exc:
        # Refused before any tracing (a flag, config, input or package problem): the message says what to do.
        return fail(ExitCode.USAGE, one_line(exc), traceback_of=exc if debug else None)
    except HfExportError as exc:
        hint = "" if debug else " (--debug shows the traceback)"
        return fail(
            ExitCode.EXPORT_FAILED, f"export failed: {one_line(exc)}{hint}", traceback_of=exc if debug else None
        )
    except Exception as exc:
        # The exit code says what happened, whatever --debug shows: the traceback goes before the same one line.
        hint = "" if debug else " (--debug shows the traceback)"
        message = f"{type(exc).__name__}: {one_line(exc)}{hint}"
        return fail(ExitCode.EXPORT_FAILED, message, traceback_of=exc if debug else None)
