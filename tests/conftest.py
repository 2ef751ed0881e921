"""Test-session hooks."""

from __future__ import annotations

import os
import sys

import pytest

# pytest-xdist runs one worker per core, and each worker's exports start command-line subprocesses of their own: with
# torch's and the BLAS libraries' default of a thread per core in every one of them, the threads outnumber the cores
# and spin-wait for each other (measured on 2 cores under load: a CLI test file took 12-15 % longer). One intra-op
# thread per process, unless the caller chose a number; subprocesses inherit it. Tests of thread handling set their
# own counts.
if os.environ.get("PYTEST_XDIST_WORKER"):
    for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_name, "1")

# The files that take longest run first (pytest-xdist hands out whole files in collection order): started last,
# the CLI matrix alone would keep one worker busy long after the other has finished.
_LONGEST_FIRST = ("tests/test_cli_matrix.py", "tests/rewrites/test_examples.py")


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER") and "torch" in sys.modules:
        import torch  # imported before this file by a plugin: the variable came too late for it

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: 0 if item.nodeid.split("::")[0] in _LONGEST_FIRST else 1)
