"""The budget every fuzzed reader runs within, one example at a time (tests/test_readers_fuzz.py).

    budget = Budget("safetensors header", seconds=2, mib=64)
    budget.run(lambda: Checkpoint.open(folder), folder, allowed=(InputError,))

`run` calls the reader and fails the example when it raises anything but `allowed`, takes longer than `seconds`
(wall time), allocates more than `mib` at its peak (tracemalloc, in a second call: Python objects, numpy and what
else reports to it) or grows the process's resident memory by more than `rss_mib`, opens a file outside `folder`
(Python-level opens under the example's parent folder, and the bait paths `/etc/passwd`, `/proc/self/environ`),
imports a module from the example's files (`evilmod`, `transformers_modules`), runs code compiled from them, or
starts a process. Each reader's examples and its slowest one are recorded (`Budget.stats`); with
`HFEXPORT_FUZZ_STATS=file` set they are appended to that file as JSON lines when the session ends.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import json
import os
import re
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Paths a hostile input points at: never opened, whatever the input.
BAIT = ("/etc/passwd", "/proc/self/environ")
# Audit events that start a process or run a shell.
_SPAWN = ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.startfile")


def _rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclass
class _Watch:
    thread: int
    root: str  # realpath of the example's parent: reads under it must stay inside `folder`
    folder: str
    found: list[str] = field(default_factory=list)

    def __call__(self, event: str, args: tuple[Any, ...]) -> None:
        if threading.get_ident() != self.thread:
            return
        if event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.path.realpath(os.fsdecode(args[0]))
            inside = path == self.folder or path.startswith(self.folder + os.sep)
            if path in BAIT or (path.startswith(self.root + os.sep) and not inside):
                self.found.append(f"opened {path}")
        elif event == "import" and args:
            name, filename = str(args[0]), args[1] if len(args) > 1 else None
            if name.startswith(("evilmod", "transformers_modules")) or (
                isinstance(filename, str) and os.path.realpath(filename).startswith(self.root + os.sep)
            ):
                self.found.append(f"imported {name} ({filename})")
        elif event == "exec" and args:
            filename = getattr(args[0], "co_filename", "")
            if os.path.realpath(filename).startswith(self.root + os.sep):
                self.found.append(f"ran code from {filename}")
        elif event.startswith(_SPAWN):
            self.found.append(f"{event} {args!r:.200}")


# One process-wide audit hook (hooks cannot be removed) that calls the watches of the running examples.
_WATCHES: list[Callable[[str, tuple[Any, ...]], None]] = []
sys.addaudithook(lambda event, args: [watch(event, args) for watch in list(_WATCHES)] and None)


def watching(hook: Callable[[str, tuple[Any, ...]], None]) -> Callable[[], None]:
    """Call `hook(event, args)` for every audit event until the returned function is called."""
    _WATCHES.append(hook)
    return lambda: _WATCHES.remove(hook)


@dataclass
class Stats:
    examples: int = 0
    slowest_s: float = 0.0
    slowest: str = ""
    peak_mib: float = 0.0
    failed: int = 0  # with HFEXPORT_FUZZ_EXPLORE: examples that failed
    failures: dict[str, str] = field(default_factory=dict)  # with HFEXPORT_FUZZ_EXPLORE: first failure of a kind


class Budget:
    """The limits of one reader's examples, and what its examples took."""

    stats: dict[str, Stats] = {}  # noqa: RUF012 (one table for the session)

    def __init__(self, reader: str, seconds: float = 2.0, mib: float = 64, rss_mib: float = 256) -> None:
        self.reader, self.seconds, self.mib, self.rss_mib = reader, seconds, mib, rss_mib
        Budget.stats.setdefault(reader, Stats())

    def warm(self, read: Callable[[], Any], allowed: tuple[type[BaseException], ...]) -> None:
        """Run `read` once outside the budget: the imports and caches of a first call are not the input's cost."""
        with contextlib.suppress(*allowed):
            read()

    def run(
        self,
        read: Callable[[], Any],
        folder: Path | None,
        allowed: tuple[type[BaseException], ...],
        describe: Any = "",
    ) -> Any:
        """`read()`'s result, or None when it raised one of `allowed`; an `AssertionError` naming `describe` when
        the example breaks a limit or raises anything else. `read` runs twice: timed (wall time, resident memory),
        then under tracemalloc (its peak of allocations), since tracing every allocation slows the reader."""
        root = os.path.realpath(folder.parent) if folder is not None else "/nonexistent"
        watch = _Watch(threading.get_ident(), root, os.path.realpath(folder) if folder is not None else root)
        where = f"{self.reader}: {str(describe)[:300]}"
        self.failed_now = False
        stop = watching(watch)
        try:
            rss, start = _rss_bytes(), time.perf_counter()
            result = self._call(read, allowed, where)
            elapsed = time.perf_counter() - start
            grown = (_rss_bytes() - rss) / 2**20
            tracemalloc.start()
            try:
                self._call(read, allowed, where)
                peak = tracemalloc.get_traced_memory()[1] / 2**20
            finally:
                tracemalloc.stop()
        finally:
            stop()
        stats = Budget.stats[self.reader]
        stats.examples += 1
        stats.peak_mib = max(stats.peak_mib, peak)
        if elapsed > stats.slowest_s:
            stats.slowest_s, stats.slowest = elapsed, str(describe)[:160]
        checks = [
            ("outside the folder or code", not watch.found, f"{where}: {watch.found[:5]}"),
            ("time", elapsed <= self.seconds, f"{where}: took {elapsed:.2f}s (budget {self.seconds}s)"),
            ("memory", peak <= self.mib, f"{where}: allocated {peak:.1f} MiB at its peak (budget {self.mib} MiB)"),
            ("rss", grown <= self.rss_mib, f"{where}: grew the resident memory by {grown:.0f} MiB ({self.rss_mib})"),
        ]
        for kind, ok, message in checks:
            if not ok:
                self._failed(kind, message)
        stats.failed += self.failed_now
        return result

    def _failed(self, kind: str, message: str) -> None:
        """Fail the example; with `HFEXPORT_FUZZ_EXPLORE` set, record the first example of each kind of failure
        instead, so that one run lists every distinct failure (and counts the examples that failed)."""
        if not os.environ.get("HFEXPORT_FUZZ_EXPLORE"):
            raise AssertionError(message)
        self.failed_now = True
        Budget.stats[self.reader].failures.setdefault(kind, message[:600])

    def _call(self, read: Callable[[], Any], allowed: tuple[type[BaseException], ...], where: str) -> Any:
        try:
            return read()
        except allowed:
            return None
        except Exception as exc:
            message = f"{where}: raised {type(exc).__name__}: {exc}"[:2000]
            if not os.environ.get("HFEXPORT_FUZZ_EXPLORE"):
                raise AssertionError(message) from exc
            self._failed(f"{type(exc).__name__}: " + re.sub(r"\d+", "N", str(exc))[:100], message)
            return None


@atexit.register
def _write_stats() -> None:
    target = os.environ.get("HFEXPORT_FUZZ_STATS")
    if target and Budget.stats:
        with open(target, "a") as file:
            for reader, stats in sorted(Budget.stats.items()):
                file.write(json.dumps({"reader": reader, **dataclasses.asdict(stats)}) + "\n")
