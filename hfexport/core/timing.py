"""Elapsed time and an estimate of what is left, as progress lines print them ("1m05s", "ETA 3m10s")."""

from __future__ import annotations


def duration(seconds: float) -> str:
    """`42s`, `3m05s`, `1h02m`: short enough for a progress line."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


def eta(done: int, total: int, elapsed: float) -> str:
    """`elapsed 1m05s, ETA 3m10s` after `done` of `total` equal-cost items took `elapsed` seconds."""
    if done <= 0 or total <= done:
        return f"elapsed {duration(elapsed)}"
    return f"elapsed {duration(elapsed)}, ETA {duration(elapsed / done * (total - done))}"
