"""Rule examples (`Match`, `NoMatch`): data on the rule, checked by `hfexport.testing.harness`.

A `Match` builds a small module and inputs on which the rule must fire and keep eager numerics; a
`NoMatch` builds one on which the rule must run, fire zero times and change nothing. Like LibCST's codemod
tests, the examples live on the rule, and `tests/rewrites/test_examples.py` runs every one of them through
the real exporters and runtimes (the harness, at the top of the package: the rule engine never imports it).

What the test run needs to know about one example is on the example too: the backends it is checked on
(`backends`), that it is too slow for the default tier (`slow`), and where it fails for a reason outside the
rule (`known_failure`, a strict expected failure per backend).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils import _pytree as pytree

Built = tuple[torch.nn.Module, dict[str, Any]]


@dataclass(frozen=True)
class Match:
    """The rule fires on `build()`'s module and the result matches eager within `atol`/`rtol`."""

    build: Callable[[], Built]
    description: str = ""
    atol: float = 1e-5
    rtol: float = 1e-5
    # Export with every tensor axis dynamic, and also check the program on `other_inputs()` (e.g. another
    # sequence length) against eager: the proof for rules whose point is a symbolic shape.
    other_inputs: Callable[[], dict[str, Any]] | None = None
    # ONNX stages: the opset to export the example at (None: the checker's default); for rules whose
    # rewrite depends on the opset.
    opset: int | None = None
    # Other rules this example's model needs on some backend (e.g. an OpenVINO conversion fix for what the
    # patch under test traces): they run with the rule under test, a rule for another backend is skipped
    # there, and they stay on when the rule is disabled to prove a fix is needed.
    needs: tuple[str, ...] = ()
    # The backends this example is checked on (default: every backend of the rule): an example of one
    # per-backend variant of a rule names that variant's backends.
    backends: tuple[str, ...] = ()
    # Checked in the slow tier only, even where it would be the rule's default-tier example (it takes tens of
    # seconds; say how long in a comment).
    slow: bool = False
    # {backend: reason}: the example fails there for a reason outside the rule (the architecture does not lower
    # there yet). A strict expected failure: the run fails the day it passes, and the entry goes then.
    known_failure: Mapping[str, str] | tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        _freeze(self)


@dataclass(frozen=True)
class NoMatch:
    """The rule runs on `build()`'s module (a patch rule is installed on it), fires zero times, changes nothing."""

    build: Callable[[], Built]
    description: str = ""
    opset: int | None = None
    # What makes it not match (shown in failures): the check the rule declines on, the shape it leaves alone.
    reason: str = ""
    # False only where no model the rule applies to can show a no-match (e.g. a replacement that declines
    # nothing a trace can reach): then the rule is not even installed here, and `reason` must say why.
    applies: bool = True
    # As for `Match`.
    backends: tuple[str, ...] = ()
    slow: bool = False
    known_failure: Mapping[str, str] | tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not self.applies and not self.reason.strip():
            raise ValueError(f"NoMatch {self.description!r}: applies=False needs a `reason`")
        _freeze(self)


Example = Match | NoMatch


def _freeze(example: Match | NoMatch) -> None:
    # Stored as tuples, so an example (and the frozen RuleMeta holding it) stays hashable.
    object.__setattr__(example, "backends", tuple(example.backends))
    failures = example.known_failure
    pairs = failures.items() if isinstance(failures, Mapping) else failures
    object.__setattr__(example, "known_failure", tuple((str(b), str(r)) for b, r in pairs))
    for backend, reason in example.known_failure:
        if not reason.strip():
            what = f"{type(example).__name__} {example.description!r}"
            raise ValueError(f"{what}: known_failure[{backend!r}] needs a reason")


def known_failure(example: Example, backend: str) -> str | None:
    """Why `example` is expected to fail on `backend` (its `known_failure` entry), or None."""
    return dict(example.known_failure).get(backend)


class ExampleFailure(AssertionError):
    """A rule example did not behave as declared."""


def assert_same_outputs(expected: Any, actual: Any, atol: float = 1e-5, rtol: float = 1e-5, what: str = "") -> None:
    """Compare two output trees leaf by leaf: floats within tolerance (NaN == NaN), others exactly."""
    exp_leaves, act_leaves = _tensor_leaves(expected), _tensor_leaves(actual)
    if len(exp_leaves) != len(act_leaves):
        raise ExampleFailure(f"{what}: {len(act_leaves)} output tensors, expected {len(exp_leaves)}")
    for i, (e, a) in enumerate(zip(exp_leaves, act_leaves, strict=True)):
        if e.shape != a.shape or e.dtype != a.dtype:
            raise ExampleFailure(f"{what}: output {i} is {a.dtype}{list(a.shape)}, expected {e.dtype}{list(e.shape)}")
        if e.is_floating_point() or e.is_complex():
            ok = torch.allclose(a, e, atol=atol, rtol=rtol, equal_nan=True)
        else:
            ok = torch.equal(a, e)
        if not ok:
            diff = (a.double() - e.double()).abs().nan_to_num(float("inf")).max().item()
            raise ExampleFailure(f"{what}: output {i} differs from eager (max abs diff {diff:.3g})")


def _tensor_leaves(tree: Any) -> list[torch.Tensor]:
    return [x.detach() for x in pytree.tree_leaves(tree) if isinstance(x, torch.Tensor)]
