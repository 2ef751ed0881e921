"""tools/bench_generate.py --quick: the whole table in one command (issue #19, goal 7), its shape, not timings."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
COLUMNS = ["run", "precision", "TTFT ms", "decode tok/s", "% of ceiling", "x eager", "tokens", "export s", "peak MB"]


def _table(output: str) -> list[list[str]]:
    lines = [line for line in output.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]


@pytest.mark.slow
def test_quick_run_prints_one_row_per_backend_and_precision() -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tools'}", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "tools/bench_generate.py", "--quick", "--backends", "dynamo", "--precisions"]
    done = subprocess.run(
        [*command, "fp32,int8", "--no-peer"], cwd=ROOT, env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    header, *rows = _table(done.stdout)
    assert header[: len(COLUMNS)] == COLUMNS and header[-1] == "note"
    assert [(r[0], r[1]) for r in rows] == [
        ("eager generate (dynamic cache)", "fp32"),
        ("hfexport dynamo (static cache)", "fp32"),
        ("hfexport dynamo (static cache)", "int8"),
    ]
    assert all(len(r) == len(header) for r in rows)
    # The fp32 export generates eager's tokens; every exported row has an export time and a measured decode.
    assert rows[1][COLUMNS.index("tokens")] == "equal"
    for row in rows[1:]:
        assert float(row[COLUMNS.index("export s")]) >= 0 and float(row[COLUMNS.index("decode tok/s")]) > 0, row


def test_timed_alternately_runs_every_setting_each_round_and_keeps_its_last_output() -> None:
    """The A/B tools' timing: round 0 warms up, then each round calls every setting with 1 token and `new` tokens
    in turn, so the settings interleave; each keeps the output of its last `new`-token call."""
    from hfexport.apps.bench import timed_alternately

    calls: list[tuple[str, int]] = []

    def setting(name: str) -> object:
        def run(n: int) -> str:
            time.sleep(0.005 * n)  # a call's time grows with its tokens, as generate's does
            calls.append((name, n))
            return f"{name}:{n}:{len(calls)}"

        return run

    timed = timed_alternately({"a": setting("a"), "b": setting("b")}, new=4, rounds=2)
    assert calls == [("a", 1), ("a", 4), ("b", 1), ("b", 4)] * 3
    assert timed["a"].output == "a:4:10" and timed["b"].output == "b:4:12"
    # 5 ms a token: TTFT at least 5 ms, and the 4-token call takes longer than the 1-token one.
    assert all(r.ttft_s >= 0.005 and r.tokens_per_s > 0 for r in timed.values())
