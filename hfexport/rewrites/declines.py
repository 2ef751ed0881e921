"""Why a rule left a matched site alone: rule kinds report declines, the engine collects them.

A node predicate returns `Declined(reason)` for a site it matched but refuses (falsy, like onnxscript's failed
`MatchResult`), and its applier returns the reasons with its hits. Code that runs where no applier can collect
(a patch replacement returning NOT_APPLICABLE during the trace) calls `note_declined(rule_id, reason)`; the engine
routes those calls of the stage it runs to that export's outcomes (`declines_to`). Kept below the kinds, so they
need no engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

# Where `note_declined` reports while an export runs a stage (set by `apply` and `patched`): rule kinds call
# it from their appliers without the context being threaded through every applier signature.
_DECLINE_SINK: ContextVar[Callable[[str, str], None] | None] = ContextVar("hfexport_decline_sink", default=None)
# Distinct reasons kept per rule: a check that words its reason per site must not grow the report unboundedly.
MAX_DECLINE_REASONS = 20


@dataclass(frozen=True)
class Declined:
    """A node predicate's answer for a site it matched but leaves alone, and why: false, so a predicate that
    returns it reads as one that returns False; the applier counts `reason` among the rule's declines."""

    reason: str

    def __bool__(self) -> bool:
        return False


def clean_reason(reason: str) -> str:
    """A decline reason as the report keeps it: one line, at most 300 characters."""
    return " ".join(str(reason).split())[:300] or "declined without a reason"


def note_declined(rule_id: str, reason: str) -> None:
    """Record that `rule_id` matched a site and declined it, and why (a no-op outside an engine stage)."""
    sink = _DECLINE_SINK.get()
    if sink is not None:
        sink(rule_id, clean_reason(reason))


# Reasons that cost extra work to collect (the ONNX rewriter gives them only to a dry-run pass) are collected
# only inside `explaining_declines()`, which `hfexport audit` enters; the reasons node predicates return are free.
_EXPLAIN: ContextVar[bool] = ContextVar("hfexport_explain_declines", default=False)


@contextmanager
def explaining_declines() -> Iterator[None]:
    """Also collect the decline reasons that cost an extra pass, for the exports started in this block."""
    token = _EXPLAIN.set(True)
    try:
        yield
    finally:
        _EXPLAIN.reset(token)


def explaining() -> bool:
    """Whether the exports of this context collect the decline reasons that cost an extra pass."""
    return _EXPLAIN.get()


@contextmanager
def declines_to(sink: Callable[[str, str], None]) -> Iterator[None]:
    """Send the `note_declined` calls made inside this block to `sink(rule_id, reason)`."""
    token = _DECLINE_SINK.set(sink)
    try:
        yield
    finally:
        _DECLINE_SINK.reset(token)
