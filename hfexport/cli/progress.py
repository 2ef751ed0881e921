"""Progress on stderr for every command: live per stage with rich on a terminal, plain lines otherwise."""

from __future__ import annotations

import sys
import time
from typing import Any


class Progress:
    """Progress on stderr: `step` for a new phase, `stage` for a pipeline stage entered during an export.

    On a terminal with rich installed, a spinner names the running stage and each finished stage is printed
    with its time; otherwise (a pipe, a log, no rich) one plain line per step and per stage.
    """

    def __init__(self, live: bool | None = None) -> None:
        self.console: Any = None
        self.status: Any = None
        self.current: tuple[str, float] | None = None
        # The stages this export has entered: a lowering that runs a stage in two passes (ONNX's fixes before
        # the optimizer and fusions after it) is one line, not two.
        self.seen: set[str] = set()
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
        if name == "patch":  # the first stage of every export (each component of a generation export)
            self.seen = set()
        if name in self.seen:
            return
        self.seen.add(name)
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


# One plain-line progress for the commands that print steps without stages (audit, scan, sweep).
PLAIN = Progress(live=False)


def step(message: str) -> float:
    return PLAIN.step(message)
