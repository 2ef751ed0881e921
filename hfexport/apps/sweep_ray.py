"""The sweep's cases as Ray tasks: `hfexport sweep --ray [ADDRESS]`.

A release-wide sweep (every architecture x 4 formats) is hours on one machine; on a Ray cluster each case is
one task in a process of its own (`max_calls=1`: a fresh worker per case, as the local sweep's child
process, so a rule's patch or a crash never leaks into the next case), and the rows are the same records
(`hfexport.apps.sweep_case.child` makes them, `SweepRow` holds them). `RayRunner` is a `hfexport.apps.sweep.CaseRunner`:

    with RayRunner() as runner:                      # a local cluster, 1 CPU; "auto" or "HOST:PORT" connects
        sweep = run_sweep(paths, "onnx", runner=runner)

Workers import hfexport from this checkout, whatever is installed on the cluster: the package folder goes
with the job (`runtime_env` `py_modules`), and each case's corpus JSON goes with its task, so a remote node
needs neither the repository nor the config files.
"""

from __future__ import annotations

import json
import re
import socket
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from hfexport.apps.sweep import SweepProgress, SweepRow, crash_row, timeout_row
from hfexport.apps.sweep_case import child, quiet_child
from hfexport.core.errors import MissingPackageError

# A case task: (entry file stem, entry JSON text, format, config JSON) -> the row as a dict.
CaseTask = Callable[[str, str, str, str], dict[str, Any]]
PACKAGE = Path(__file__).resolve().parents[1]  # the hfexport package folder, which travels with the job
# How long a named address may take to accept a connection: ray.init itself retries an unreachable GCS for
# minutes before it gives up.
CONNECT_TIMEOUT_S = 5.0
STARTED = "hfexport-sweep-case-started"  # a case task's first item


class RayUnavailableError(ConnectionError):
    """The Ray cluster named by `--ray` cannot be reached (or started); the message is one line."""


def run_case(stem: str, entry_json: str, export_format: str, config_json: str) -> dict[str, Any]:
    """The body of a case task, in its Ray worker: the local sweep's child, on the entry's JSON text."""
    quiet_child()
    with tempfile.TemporaryDirectory(prefix="hfexport-sweep-entry-") as tmp:
        path = Path(tmp) / f"{stem}.json"  # the stem names the row of an entry too broken to name itself
        path.write_text(entry_json)
        return child(str(path), export_format, config_json)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise MissingPackageError(
            "--ray needs ray, which is not installed: pip install 'hfexport[ray]' (or drop --ray to sweep locally)"
        ) from None
    return ray


def _auto_address() -> str | None:
    """The address `auto` means (RAY_ADDRESS, else the last `ray start`'s, else a running cluster's), so that a
    stale one is probed too; None where this Ray resolves it differently (then ray.init does)."""
    try:
        from ray._private.services import canonicalize_bootstrap_address
    except ImportError:
        return None
    try:
        return canonicalize_bootstrap_address("auto")
    except ConnectionError as exc:  # no cluster found: Ray's message says where it looked
        raise RayUnavailableError(f"--ray auto: {' '.join(str(exc).split())}") from None
    except Exception:
        return None


def _probe(address: str) -> None:
    """Refuse an address nothing listens on in seconds, not after ray.init's minutes of retries."""
    target, shown = address, address
    if address == "auto":
        resolved = _auto_address()
        if resolved is None:
            return
        target, shown = resolved, f"auto ({resolved})"
    host, sep, port = target.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        raise RayUnavailableError(f"--ray {shown}: expected auto, HOST:PORT or ray://HOST:PORT")
    try:
        with socket.create_connection((host, int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as exc:
        raise RayUnavailableError(f"--ray {shown}: cannot reach a Ray cluster there ({exc})") from None


@dataclass
class RayRunner:
    """Runs the sweep's cases as Ray tasks, `jobs` in flight at once; a context manager around the connection.

    `address=None` starts a local cluster of `jobs` CPUs (default 1) without the dashboard; `"auto"` or an
    address connects to a running one, and `jobs` defaults to its CPU count. At most `jobs` cases are in
    flight. A case's timeout counts from its start in its worker (a task first yields `STARTED`); past it, or
    past as long waiting for a worker, the task is cancelled, its worker killed, and the case is a `timeout`
    row. A worker that dies, or a task that raises, is a `crash` row.
    `task` is the function a case runs (`run_case`; the fault tests give one that dies or hangs).
    """

    address: str | None = None
    jobs: int | None = None
    task: CaseTask = run_case
    _ray: Any = field(default=None, init=False, repr=False)
    _remote: Any = field(default=None, init=False, repr=False)
    _connected: bool = field(default=False, init=False, repr=False)

    def __enter__(self) -> RayRunner:
        self.connect()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()

    def connect(self) -> None:
        """Start the local cluster or connect to `address`; `RayUnavailableError` if that fails."""
        ray = _import_ray()
        if self.address is not None:
            _probe(self.address)
        runtime_env = {"py_modules": [str(PACKAGE)], "excludes": ["__pycache__", "*.pyc"]}
        options: dict[str, Any] = {
            "include_dashboard": False,
            "log_to_driver": False,  # a case's output is its row; the warnings of 100 workers are noise
            "logging_level": "ERROR",
            "runtime_env": runtime_env,
        }
        if self.address is None:
            options.update(address="local", num_cpus=self.jobs or 1)
        else:
            options.update(address=self.address)
        try:
            ray.init(**options)
        except Exception as exc:
            where = "start a local Ray cluster" if self.address is None else f"connect to Ray at {self.address}"
            text = " ".join(str(exc).split()) or type(exc).__name__
            raise RayUnavailableError(f"--ray: cannot {where}: {text[:300]}") from None
        self._ray, self._connected = ray, True
        if self.jobs is None:
            self.jobs = max(1, int(ray.cluster_resources().get("CPU", 1)))
        # One CPU per case; max_calls=1: a fresh worker process per case; max_retries=0: a case that kills
        # its worker is a crash row, not run again (a segfault would repeat).
        self._remote = ray.remote(num_cpus=1, max_calls=1, max_retries=0, num_returns="streaming")(_stream)

    def close(self) -> None:
        """Disconnect; a local cluster started by `connect` is shut down with its processes."""
        if self._connected:
            self._ray.shutdown()
            self._connected = False

    def describe(self) -> str:
        where = "a local Ray cluster" if self.address is None else f"Ray at {self.address}"
        return f"on {where}, {self.jobs} at once"

    def run(
        self,
        paths: Sequence[Path],
        export_format: str,
        config: dict[str, Any],
        timeout: float,
        progress: SweepProgress,
    ) -> list[SweepRow]:
        if not self._connected:
            raise RuntimeError("RayRunner.run before connect(): use `with RayRunner(...) as runner:`")
        config_json = json.dumps(config)
        rows: list[SweepRow | None] = [None] * len(paths)
        waiting = list(enumerate(paths))
        running: dict[Any, _Case] = {}  # the task's stream -> its case

        def finish(stream: Any, row: SweepRow) -> None:
            rows[running.pop(stream).index] = row
            progress.case_done(row)

        try:
            while waiting or running:
                while waiting and len(running) < max(1, self.jobs or 1):
                    index, path = waiting.pop(0)
                    text = path.read_bytes().decode("utf-8", errors="replace")
                    stream = self._remote.remote(self.task, path.stem, text, export_format, config_json)
                    running[stream] = _Case(index, path, time.perf_counter())
                wait = min(case.deadline(timeout) for case in running.values()) - time.perf_counter()
                ready, _ = self._ray.wait(list(running), num_returns=1, timeout=max(0.0, wait))
                for stream in ready:
                    case = running[stream]
                    row = self._next(stream, case)
                    if row is None:  # the case began in its worker: its timeout counts from now
                        case.started = time.perf_counter()
                        progress.case_started(case.path)
                    else:
                        finish(stream, row)
                now = time.perf_counter()
                for stream, case in list(running.items()):
                    if now >= case.deadline(timeout):
                        self._ray.cancel(stream, force=True)  # kills the worker: the export stops now
                        row = timeout_row(case.path, timeout)
                        if case.started is None:
                            row.error = f"waited over {timeout:.0f}s for a worker (no free CPU on the cluster?)"
                        finish(stream, row)
        finally:
            for stream in running:  # interrupted: leave no case running on a cluster that outlives the sweep
                self._ray.cancel(stream, force=True)
        return [row for row in rows if row is not None]

    def _next(self, stream: Any, case: _Case) -> SweepRow | None:
        """The task's next item: None for its start, then its row; a crash row if its worker died or it
        raised."""
        since = case.submitted if case.started is None else case.started
        try:
            found = self._ray.get(next(stream))
        except StopIteration:
            return crash_row(case.path, "the task ended without a row", time.perf_counter() - since)
        except Exception as exc:  # ray.exceptions.RayError: WorkerCrashedError, RayTaskError, ...
            return crash_row(case.path, _one_line(exc), time.perf_counter() - since)
        if found == STARTED:
            return None
        row = SweepRow(**found)
        row.wall_s = round(time.perf_counter() - since, 1)
        return row


@dataclass
class _Case:
    """A case submitted as a task: where its row goes, and when it was submitted and began in its worker."""

    index: int
    path: Path
    submitted: float
    started: float | None = None

    def deadline(self, timeout: float) -> float:
        # Waiting for a worker and running each get `timeout`: a busy cluster's queue is not the case's hang.
        return (self.submitted if self.started is None else self.started) + timeout


def _stream(task: CaseTask, *args: str) -> Iterator[Any]:
    """A case task as Ray runs it: first `STARTED` (so the driver's timeout counts from the case's start in
    its worker, not from its submission), then the row."""
    yield STARTED
    yield task(*args)


def _one_line(exc: BaseException) -> str:
    """`WorkerCrashedError: The worker died ...`, or for an exception the task raised, that exception."""
    cause = getattr(exc, "cause", None)  # RayTaskError wraps what the task raised
    if isinstance(cause, BaseException):
        exc = cause
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))  # Ray colours its messages
    return f"{type(exc).__name__}: {' '.join(text.split())}"
