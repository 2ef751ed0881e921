"""The command's exit codes, and how an exception becomes one line on stderr and one of them.

A user mistake (a typo in a flag, a bad `--config`, a rule id that does not exist, a model folder without a
config, an output folder that cannot be written) is refused before any work, as one line that says what is
wrong and what to do. A traceback is shown only with `--debug` or `HFEXPORT_DEBUG=1`.
"""

from __future__ import annotations

import os
import sys
from enum import IntEnum


class ExitCode(IntEnum):
    """One table, documented in docs/cli.md ("Exit codes")."""

    OK = 0
    DIFFERS = 1  # validation ran and the artifact differs from eager (or tokens from generate)
    USAGE = 2  # a user mistake: refused before any work
    EXPORT_FAILED = 3  # a pipeline stage (or an unexpected error) failed
    REFUSED = 4  # `check`: the artifact was refused (manifest, paths, checksums, format)
    # Ctrl-C (128 + SIGINT, as shells report it). A SIGINT the parent process ignored stays ignored, as in every
    # Unix command (Python installs its handler only over the default): a shell without job control starts
    # `cmd &` so, so that a Ctrl-C in the terminal stops the script's foreground command, not its background ones.
    INTERRUPTED = 130


class UsageError(Exception):
    """A user mistake the command refuses before any work; the message is one line: what, and what to do."""


def debug_enabled(argv: list[str] | None = None) -> bool:
    """`--debug` on the command line or `HFEXPORT_DEBUG` set to anything but 0/empty."""
    args = sys.argv[1:] if argv is None else argv
    return "--debug" in args or os.environ.get("HFEXPORT_DEBUG", "") not in ("", "0")


def one_line(exc: BaseException) -> str:
    """The first line of an exception's text (the rest of a long conversion report is for `--debug`)."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def fail(code: ExitCode, message: str, traceback_of: BaseException | None = None) -> int:
    """Print `error: message` on stderr and return `code`. With `traceback_of` (`--debug`), its traceback
    comes first; the last line and the exit code are the same with and without it."""
    if traceback_of is not None:
        import traceback

        traceback.print_exception(traceback_of, file=sys.stderr)
    print(f"error: {message}", file=sys.stderr)
    return int(code)
