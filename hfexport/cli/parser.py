"""The `hfexport` argument parser and `main`: each subcommand calls its module's `cmd_*` function."""

from __future__ import annotations

import argparse
import sys

from hfexport.cli.audit import cmd_audit
from hfexport.cli.check import cmd_check
from hfexport.cli.export import cmd_export
from hfexport.cli.models import QUANTIZE_RECIPES, TASKS
from hfexport.cli.rules import cmd_rules_list, cmd_rules_show
from hfexport.cli.scan import cmd_scan
from hfexport.cli.sweep import cmd_sweep
from hfexport.formats import FORMATS
from hfexport.rewrites.rule import BACKENDS, STAGES

DESCRIPTION = "The `hfexport` command (also `python -m hfexport`)."


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
        prog="hfexport", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
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
