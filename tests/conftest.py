"""Test-session hooks."""

from __future__ import annotations

import pytest

# The files that take longest run first (pytest-xdist hands out whole files in collection order): started last,
# the CLI matrix alone would keep one worker busy long after the other has finished.
_LONGEST_FIRST = ("tests/test_cli_matrix.py", "tests/rewrites/test_examples.py")


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: 0 if item.nodeid.split("::")[0] in _LONGEST_FIRST else 1)
