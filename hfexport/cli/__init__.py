"""The `hfexport` command (also `python -m hfexport`).

hfexport export --model tiny-llama --format onnx --output out/ --validate [--device cpu] [--report-html r.html]
hfexport audit --model tiny-qwen3-moe --format onnx [--json audit.json] [--explain] [--ablate [ID ...]]
hfexport rules list [--stage fx] [--backend onnx]
hfexport rules show patch/longt5-pad-blocks
hfexport scan [--models llama,qwen2] [--path file_or_folder] [--json scan.json]
hfexport sweep --configs tests/fixtures/corpus/causal_lm --format onnx [--html h.html] [--png h.png] [--csv F]
    [--jobs N] [--ray [auto|HOST:PORT]]
hfexport check out/ [--trust]

Progress goes to stderr (live per stage with rich on a terminal, plain lines otherwise), results to stdout.
Exit codes (`exits.ExitCode`, docs/cli.md): 0 success; 1 the artifact differs from eager; 2 a usage mistake,
refused before any work; 3 the export failed; 4 `check` refused the artifact; 130 interrupted.

One module per command group (`export`, `audit`, `rules`, `scan`, `check`, `sweep`), the parser and `main`
(`parser`), and what they share: `progress` (stderr progress), `models` (model and config from arguments),
`folder_inputs` (sample inputs of a folder's image, speech and vision-language models), `exits` (exit codes,
one-line errors) and `noise` (third-party messages hidden unless `--debug`).
"""

from __future__ import annotations

from hfexport.cli.parser import build_parser, main
from hfexport.cli.progress import Progress

__all__ = ["Progress", "build_parser", "main"]
