"""Why a rule left a matched site alone: rule kinds report declines here, the engine collects them.

A rule kind's applier calls `note_declined(rule_id, reason)` when a match is refused (an FX check's reason, a
patch replacement returning NOT_APPLICABLE, an ONNX rewriter check's failure); the engine routes the calls of
the stage it runs to that export's outcomes (`declines_to`). Kept below the kinds, so they need no engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

# Where `note_declined` reports while an export runs a stage (set by `apply` and `patched`): rule kinds call
# it from their appliers without the context being threaded through every applier signature.
_DECLINE_SINK: ContextVar[Callable[[str, str], None] | None] = ContextVar("hfexport_decline_sink", default=None)
# Distinct reasons kept per rule: a check that words its reason per site must not grow the report unboundedly.
MAX_DECLINE_REASONS = 20


def note_declined(rule_id: str, reason: str) -> None:
    """Record that `rule_id` matched a site and declined it, and why (a no-op outside an engine stage)."""
    sink = _DECLINE_SINK.get()
    if sink is not None:
        sink(rule_id, " ".join(str(reason).split())[:300] or "declined without a reason")


# Reasons that cost extra work to collect (the ONNX rewriter gives them only to a dry-run pass) are collected
# only inside `explaining_declines()`, which `hfexport audit` enters; the reasons FX checks return are free.
_EXPLAIN: ContextVar[bool] = ContextVar("hfexport_explain_declines", default=False)


@contextmanager
def explaining_declines() -> Iterator[None]:
    """Also collect the decline reasons that cost an extra pass, for the exports started in this block."""
    token = _EXPLAIN.set(True)
    try:
        yield
    finally:
        _EXPLAIN.reset(token)


def recording_declines(costly: bool = False) -> bool:
    """Whether `note_declined` goes anywhere; with `costly`, also whether `explaining_declines` asked for it."""
    return _DECLINE_SINK.get() is not None and (not costly or _EXPLAIN.get())


@contextmanager
def declines_to(sink: Callable[[str, str], None]) -> Iterator[None]:
    """Send the `note_declined` calls made inside this block to `sink(rule_id, reason)`."""
    token = _DECLINE_SINK.set(sink)
    try:
        yield
    finally:
        _DECLINE_SINK.reset(token)
