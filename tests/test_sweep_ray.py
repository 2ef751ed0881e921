"""`hfexport sweep --ray`: the sweep's cases as tasks on a real local Ray cluster, the same records as the local
sweep; a dead worker and a hang become rows; a missing ray or an unreachable cluster is one line and exit 2;
no Ray process outlives the sweep.

Each Ray test starts its own small cluster (1-2 CPUs, no dashboard) under a temporary folder of its own
(`RAY_TMPDIR`), which every Ray process names on its command line: that is how the tests find leftovers.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from hfexport.apps.sweep import LocalRunner, SweepRow, run_sweep
from hfexport.cli import main
from hfexport.testing.corpus import default_root

BROKEN = '{"not": "a corpus entry"}'


def _ray_processes(folder: str) -> list[str]:
    """The command lines of live processes that name `folder` (a cluster's RAY_TMPDIR)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        if folder in cmdline:
            found.append(f"{proc.name}: {cmdline[:200]}")
    return found


def _assert_no_ray_processes_left(folder: str) -> None:
    # Shutdown signals the cluster's processes; give them a moment to exit before calling one a leftover.
    for _ in range(120):
        if not _ray_processes(folder):
            return
        time.sleep(0.5)
    raise AssertionError(f"Ray processes left behind: {_ray_processes(folder)}")


@pytest.fixture
def ray_tmpdir() -> Iterator[str]:
    # Short on purpose: Ray's unix sockets live under it, and a socket path is limited to ~107 bytes.
    folder = tempfile.mkdtemp(prefix="hfx-ray-", dir="/tmp")
    yield folder
    _assert_no_ray_processes_left(folder)
    shutil.rmtree(folder, ignore_errors=True)


def test_ray_not_installed_is_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` now raises ImportError, as without the package
    code = main(["sweep", "--configs", str(default_root() / "causal_lm" / "llama.json"), "--ray"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "--ray needs ray, which is not installed: pip install 'hfexport[ray]'" in err
    assert "sweeping" not in err


def test_jobs_below_one_is_refused_before_ray_starts(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["sweep", "--configs", str(default_root() / "causal_lm" / "llama.json"), "--ray", "--jobs", "0"])
    err = capsys.readouterr().err
    assert code == 2 and err == "error: --jobs must be at least 1, not 0\n"


def test_an_unreachable_ray_address_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    pytest.importorskip("ray")
    with socket.socket() as probe:  # a port nothing listens on once this socket is closed
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # `auto` finds the address of the last `ray start` in RAY_TMPDIR/ray: here one of a cluster long gone.
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{port}")
    entry = str(default_root() / "causal_lm" / "llama.json")
    for address, says in (
        (f"127.0.0.1:{port}", f"--ray 127.0.0.1:{port}: cannot reach a Ray cluster there"),
        ("auto", f":{port}): cannot reach a Ray cluster there"),  # `--ray auto (IP:PORT): ...`
        ("nowhere", "expected auto, HOST:PORT or ray://HOST:PORT"),
    ):
        code = main(["sweep", "--configs", entry, "--ray", address])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and says in err, err
        assert "sweeping" not in err


@pytest.mark.slow
def test_cli_ray_sweep_gives_the_local_sweeps_records(tmp_path: Path, ray_tmpdir: str) -> None:
    pytest.importorskip("ray")
    configs = tmp_path / "configs"
    configs.mkdir()
    shutil.copy(default_root() / "causal_lm" / "llama.json", configs)
    (configs / "broken.json").write_text(BROKEN)
    out = {k: tmp_path / f"sweep.{k}" for k in ("csv", "json")}
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "RAY_TMPDIR": ray_tmpdir}
    command = [sys.executable, "-m", "hfexport", "sweep", "--configs", str(configs), "--format", "dynamo", "--ray"]
    command += [x for k, p in out.items() for x in (f"--{k}", str(p))]
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "on a local Ray cluster, 1 at once" in result.stderr
    assert "[2/2 done]" in result.stderr and "elapsed" in result.stderr and "ETA" in result.stderr

    data = json.loads(out["json"].read_text())
    rows = {r["model"]: r for r in data["rows"]}
    assert set(rows) == {"causal_lm/llama", "broken"}
    llama = rows["causal_lm/llama"]
    assert llama["status"] == "ok" and llama["hits"] == {} and llama["max_abs_diff"] <= llama["tolerance"]
    assert set(llama) == {*asdict(SweepRow("x")), "ok"}
    assert data["summary"].startswith("dynamo: 1/2 models ok")
    assert out["csv"].read_text().splitlines()[0].startswith("model,status,max_abs_diff,tolerance,export_s,")

    # The same entry through the local runner: the same record, field for field, but for the time it took.
    local = run_sweep([configs / "broken.json"], "dynamo", runner=LocalRunner(1)).rows[0]
    assert {**rows["broken"], "wall_s": 0} == {**asdict(local), "ok": False, "wall_s": 0}
    assert local.status == "invalid-config" and "KeyError" in local.error


@pytest.mark.slow  # a second local cluster (~40 s); the CLI sweep above keeps Ray in the default tier
def test_ray_runner_turns_a_dead_worker_a_failed_task_and_a_hang_into_rows(
    tmp_path: Path, ray_tmpdir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("ray")
    from hfexport.apps.sweep_ray import RayRunner

    def faulty(stem: str, entry_json: str, export_format: str, config_json: str) -> dict[str, Any]:
        # A local function, so Ray ships it by value to workers that know only hfexport.
        if stem == "dies":
            os._exit(3)  # as a segfault or the OOM killer would end the worker
        if stem == "raises":
            raise MemoryError("no room for the experts")
        time.sleep(600)  # hangs
        return {}

    paths = []
    for name in ("dies", "hangs", "raises"):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(BROKEN)
    monkeypatch.setenv("RAY_TMPDIR", ray_tmpdir)
    lines: list[str] = []
    # The timeout covers a worker's start on a busy machine; only the hanging case reaches it. (The real
    # case task is tested through the command above.)
    with RayRunner(jobs=3, task=faulty) as runner:
        sweep = run_sweep(paths, "dynamo", timeout=20, progress=lines.append, runner=runner)
        assert _ray_processes(ray_tmpdir)  # the check below would see a live cluster
    rows = {row.model: row for row in sweep.rows}
    assert [row.model for row in sweep.rows] == ["dies", "hangs", "raises"]
    assert rows["dies"].status == "crash" and "WorkerCrashedError" in rows["dies"].error
    assert rows["raises"].status == "crash" and rows["raises"].error == "MemoryError: no room for the experts"
    assert rows["hangs"].status == "timeout" and rows["hangs"].error == "over 20s"
    assert sum(" done] " in line for line in lines) == 3 and "[3/3 done]" in lines[-1] and "elapsed" in lines[-1]
    _assert_no_ray_processes_left(ray_tmpdir)
