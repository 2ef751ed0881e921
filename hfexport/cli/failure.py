"""What `hfexport export` says when an architecture cannot be exported: the stage, the line of the model's
source that failed, and what to do next, in a few lines. torch's whole message (its advice, the partial graph
it prints) is for `--debug`.
"""

from __future__ import annotations

import contextlib
import re
import sys
import traceback
from collections.abc import Iterator
from typing import Any, TextIO

from hfexport.cli.exits import debug_enabled

# `File "<path>", line N, in <function>` and the code on the next line, as tracebacks and torch's
# "The following call raised this error" print them.
_FRAME = re.compile(r'File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<function>\S+)\n\s+(?P<code>[^\n]+)')


def _is_model(path: str) -> bool:
    """A model's own source: transformers' modeling files, or a folder's remote code (`transformers_modules`)."""
    return "/transformers/models/" in path or "/transformers_modules/" in path


def source_line(exc: BaseException) -> str | None:
    """`path:line in function: code` of the model's source that was running when `exc` was raised: the call
    torch's message names ("The following call raised this error"), else the last model frame of the
    traceback; None when no model code was running."""
    chain = _chain(exc)
    frames = [m.groupdict() for e in chain for m in _FRAME.finditer(str(e)) if _is_model(m["path"])]
    if not frames:
        frames = [
            {"path": f.filename, "line": f.lineno, "function": f.name, "code": f.line}
            for e in chain
            for f in traceback.extract_tb(e.__traceback__)
            if f.line and _is_model(f.filename)
        ]
    if not frames:
        return None
    frame = frames[-1]
    path = str(frame["path"])
    for root in ("transformers/models/", "transformers_modules/"):
        if root in path:
            path = path[path.index(root) :]
            break
    return f"{path}:{frame['line']} in {frame['function']}: {str(frame['code']).strip()}"


def _chain(exc: BaseException) -> list[BaseException]:
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen


def failure_lines(exc: Any, model: str, export_format: str) -> list[str]:
    """The lines `export` prints for a failed export `exc` (an `HfExportError`): what failed where, the
    model's line, and the next steps."""
    detail = (str(getattr(exc, "detail", exc)).strip().splitlines() or [type(exc).__name__])[0]
    detail = re.sub(r"\s+", " ", detail)
    where = f"stage {exc.stage!r}" + (f", rule {exc.rule_id!r}" if getattr(exc, "rule_id", None) else "")
    subject = f" ({exc.model})" if getattr(exc, "model", None) else ""
    lines = [f"error: export failed at {where}{subject}: {detail}"]
    line = source_line(exc)
    if line is not None:
        lines.append(f"  at {line}")
    scan = "hfexport scan --models <its model type>"
    if line is not None and line.startswith("transformers/models/"):
        scan = f"hfexport scan --models {line.split('/')[2]}"
    lines.append(
        f"  next: `{scan}` finds export hazards in its code; `hfexport audit --model {model} --format "
        f"{export_format} --explain` says what each rule did; a fix is a rule (docs/authoring-rules.md); "
        "--debug shows the whole error and torch's partial graph"
    )
    return lines


class _PartialGraphFilter:
    """sys.stderr for the duration of an export, less the partial FX graph torch.export prints there when a
    trace fails (`torch/export/_trace.py`: `print(e.partial_fx_graph, file=sys.stderr)`, twice, hundreds of
    lines). Each such print is one write of the graph's code and one of its newline; nothing else is dropped."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._dropped = False

    def write(self, text: str) -> int:
        if text.lstrip("\n").startswith(("def forward(self", "class GraphModule(")):
            self._dropped = True
            return len(text)
        if self._dropped and text == "\n":
            self._dropped = False
            return len(text)
        self._dropped = False
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def without_partial_graphs(debug: bool) -> Iterator[None]:
    """Hide torch's partial-graph dump on stderr in the block (shown with `--debug`)."""
    if debug:
        yield
        return
    original = sys.stderr
    sys.stderr = _PartialGraphFilter(original)  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stderr = original


def say_failed(args: Any, exc: Exception) -> None:
    """A failed export in a few lines (stage, the model's line, next steps); the whole error with `--debug`."""
    if debugging(args):
        print(f"error: export failed: {exc}", file=sys.stderr)
        return
    for line in failure_lines(exc, args.model, args.format):
        print(line, file=sys.stderr)


def debugging(args: Any) -> bool:
    """Whether the whole error is wanted: `--debug` on the command, or `debug_enabled` says so."""
    return bool(getattr(args, "debug", False)) or debug_enabled([])
