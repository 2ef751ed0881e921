"""Validation of saved exports: run an artifact in its own runtime and compare it with eager, output by output.

Saving and loading live beside this module (`hfexport.artifacts.publish`, `.loaded`, `.manifest`); this one holds
what the CLI's `--validate` and the audit add on top: eager references by output name, the comparison, and the
`Validation` record written into the manifest. Outputs are compared by name: the flattened model-output
names (`logits`, `cache.layers_0_keys`) that the lowerings give graph outputs, with the `output.` prefix of
in-place cache pairs removed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hfexport.artifacts.loaded import load
from hfexport.naming import named_outputs


@dataclass
class OutputDiff:
    """One output of an artifact against eager: the max abs diff and the tolerance it was held to."""

    name: str
    max_abs_diff: float
    tolerance: float
    shape: tuple[int, ...] = ()
    problem: str = ""

    @property
    def ok(self) -> bool:
        return not self.problem and self.max_abs_diff <= self.tolerance

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "shape": list(self.shape), "ok": self.ok}


@dataclass
class ShapeCheck:
    """The artifact against eager on inputs of another shape than the traced sample (grown, long, another batch)."""

    name: str
    shapes: dict[str, list[int]]
    outputs: list[OutputDiff] = field(default_factory=list)
    # Why the artifact could not run these inputs at all (a static axis, a bound), or "".
    problem: str = ""
    # Why the check did not run: eager itself refused these inputs (only where the caller allows that), or "".
    skipped: str = ""

    @property
    def ok(self) -> bool:
        if self.skipped:
            return True
        return not self.problem and bool(self.outputs) and all(o.ok for o in self.outputs)

    def to_dict(self) -> dict[str, Any]:
        record = {
            "name": self.name,
            "shapes": self.shapes,
            "ok": self.ok,
            "problem": self.problem,
            "outputs": [o.to_dict() for o in self.outputs],
        }
        if self.skipped:
            record["skipped"] = self.skipped
        return record


@dataclass
class Validation:
    """The artifact run in its own runtime against the eager model on the same inputs (and on `checks`: the
    same comparison on inputs of other shapes)."""

    export_format: str
    outputs: list[OutputDiff] = field(default_factory=list)
    atol: float = 0.0
    rtol: float = 0.0
    checks: list[ShapeCheck] = field(default_factory=list)
    # Where atol and rtol come from (the weights' dtype, the user's flags), said with the verdict.
    tolerance_source: str = ""

    @property
    def ok(self) -> bool:
        return bool(self.outputs) and all(o.ok for o in self.outputs) and all(c.ok for c in self.checks)

    @property
    def max_abs_diff(self) -> dict[str, float]:
        return {o.name: o.max_abs_diff for o in self.outputs}

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "atol": self.atol,
            "rtol": self.rtol,
            "tolerance_source": self.tolerance_source,
            "outputs": [o.to_dict() for o in self.outputs],
            "shapes": [c.to_dict() for c in self.checks],
        }

    def __str__(self) -> str:
        source = f": {self.tolerance_source}" if self.tolerance_source else ""
        lines = [
            f"validation ({self.export_format} runtime vs eager, |diff| <= atol {self.atol:g} + rtol {self.rtol:g} "
            f"* max|eager|{source}):"
        ]
        for o in self.outputs:
            verdict = "ok" if o.ok else "FAIL"
            detail = o.problem or f"max abs diff {o.max_abs_diff:.3g} (tolerance {o.tolerance:.3g})"
            lines.append(f"  {verdict:4s} {o.name} {list(o.shape)}: {detail}")
        if not self.outputs:
            lines.append("  FAIL no outputs to compare")
        for check in self.checks:
            shapes = ", ".join(f"{k} {v}" for k, v in check.shapes.items())
            if check.skipped:
                lines.append(f"  skip {check.name} ({shapes}): {check.skipped}")
                continue
            if check.problem:
                lines.append(f"  FAIL {check.name} ({shapes}): {check.problem}")
                continue
            worst = max(check.outputs, key=lambda o: o.max_abs_diff / max(o.tolerance, 1e-30), default=None)
            detail = f"max abs diff {worst.max_abs_diff:.3g} on {worst.name}" if worst else "no outputs"
            lines.append(f"  {'ok' if check.ok else 'FAIL':4s} {check.name} ({shapes}): {detail}")
        return "\n".join(lines)


# -- running an artifact in its own runtime ------------------------------------------------------------------


def eager_outputs(model: Any, inputs: Mapping[str, Any]) -> dict[str, Any]:
    import torch

    with torch.no_grad():
        return named_outputs(model(**inputs))


def run_artifact(directory: str | Path, inputs: Mapping[str, Any], trust: bool = False) -> dict[str, Any]:
    """Load the (single-component) artifact in `directory` in its runtime; run it on forward kwargs `inputs`."""
    return load(directory, trust=trust).run(inputs)


def compare(expected: Mapping[str, Any], actual: Mapping[str, Any], atol: float, rtol: float) -> list[OutputDiff]:
    """Each eager output against the artifact's output of the same name (by position when names differ)."""
    import torch

    if set(expected) != set(actual) and len(expected) == len(actual):
        # A runtime that lost the names (an unnamed OpenVINO result) still keeps the order.
        actual = dict(zip(expected, actual.values(), strict=True))
    diffs = []
    for name, want in expected.items():
        got = actual.get(name)
        scale = want.abs().max().item() if want.is_floating_point() and want.numel() else 0.0
        tolerance = atol + rtol * scale
        shape = tuple(want.shape)
        if got is None:
            diffs.append(OutputDiff(name, math.inf, tolerance, shape, "missing from the artifact's outputs"))
            continue
        got = torch.as_tensor(got)
        if tuple(got.shape) != shape:
            diffs.append(OutputDiff(name, math.inf, tolerance, shape, f"shape {list(got.shape)}, eager {list(shape)}"))
            continue
        if want.numel() == 0:
            diffs.append(OutputDiff(name, 0.0, tolerance, shape))
            continue
        diff = (got.double() - want.double()).abs().nan_to_num(math.inf).max().item()
        diffs.append(OutputDiff(name, diff, tolerance, shape))
    return diffs


def validate(
    directory: str | Path,
    model: Any,
    inputs: Mapping[str, Any],
    atol: float = 1e-4,
    rtol: float = 1e-3,
    *,
    trust: bool = False,
    component: str | None = None,
    other_inputs: Mapping[str, Mapping[str, Any]] | None = None,
    eager_may_refuse: bool = False,
) -> Validation:
    """Load the saved artifact, run it in its own runtime and compare every output with eager `model(**inputs)`.

    `trust` is passed to `hfexport.load` (a `.pt2` needs it); `component` picks one of a multi-component export.
    `other_inputs` (name -> forward kwargs of other shapes, e.g. a grown sequence or another batch) are compared
    the same way, each a `ShapeCheck`: an artifact that refuses a shape (an axis the export made static) fails
    that check with the runtime's reason instead of raising. With `eager_may_refuse`, a shape the eager model
    itself refuses is a skipped check with eager's reason (see `check_shapes`).
    """
    loaded = load(directory, trust=trust)
    expected = eager_outputs(model, inputs)
    actual = loaded.run(inputs, component)
    validation = Validation(loaded.export_format, compare(expected, actual, atol, rtol), atol, rtol)
    validation.checks = check_shapes(
        lambda feed: loaded.run(feed, component),
        model,
        other_inputs or {},
        atol,
        rtol,
        eager_may_refuse=eager_may_refuse,
    )
    return validation


def validate_export(
    directory: str | Path,
    model: Any,
    inputs: Mapping[str, Any],
    *,
    atol: float,
    rtol: float,
    other_inputs: Mapping[str, Mapping[str, Any]],
    used: Mapping[str, Any],
    trust: bool = False,
) -> Validation:
    """`validate` as `hfexport export --validate` runs it: on the traced sample and on `other_inputs`, a shape eager
    itself refuses a skipped check with eager's reason, and a shape the export keeps static by design (`used`: its
    report's, see `static_by_design`) a skipped check saying so."""
    others, skipped = static_by_design(other_inputs, used)
    validation = validate(
        directory, model, inputs, atol=atol, rtol=rtol, trust=trust, other_inputs=others, eager_may_refuse=True
    )
    validation.checks += skipped
    return validation


def static_by_design(
    others: Mapping[str, Mapping[str, Any]], used: Mapping[str, Any]
) -> tuple[dict[str, Mapping[str, Any]], list[ShapeCheck]]:
    """The other-shape feeds the artifact can take, and a skipped check for each one it refuses by design, as
    the export said when exporting: another image count than the one it kept (`used["image_count"]`), another
    size on an axis the trace fixed (`used["static_axes"]`, e.g. Mamba's sequence on ExecuTorch)."""
    counts = used.get("image_count") or {}
    axes = used.get("static_axes") or {}
    kept, skipped = {}, []
    for name, feed in others.items():
        why = [f"{k} holds {n} image(s)" for k, n in counts.items() if k in feed and feed[k].shape[0] != n]
        why += [
            f"{k} axis {axis} is {size}"
            for k, fixed in axes.items()
            for axis, size in fixed.items()
            if k in feed and feed[k].ndim > int(axis) and feed[k].shape[int(axis)] != size
        ]
        if not why:
            kept[name] = feed
            continue
        shapes = {k: list(v.shape) for k, v in feed.items() if hasattr(v, "shape")}
        reason = f"the export keeps it static ({', '.join(why)} in the sample, said when exporting): refused by design"
        skipped.append(ShapeCheck(name, shapes, skipped=reason))
    return kept, skipped


def _first_line(exc: BaseException) -> str:
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
    return f"{type(exc).__name__}: {first}"


def check_shapes(
    run: Callable[[Mapping[str, Any]], Mapping[str, Any]],
    model: Any,
    other_inputs: Mapping[str, Mapping[str, Any]],
    atol: float,
    rtol: float,
    *,
    outputs: Sequence[str] | None = None,
    eager_may_refuse: bool = False,
) -> list[ShapeCheck]:
    """One `ShapeCheck` per feed of `other_inputs`: `run(feed)` (an artifact in its runtime, or any callable
    returning named outputs) against eager on the same feed.

    `outputs` limits the comparison to those names (the corpus compares its main output). With
    `eager_may_refuse`, a feed that eager itself cannot run (a generated shape beyond what the model accepts)
    is a skipped check rather than an error: it says nothing about the artifact.
    """
    checks = []
    for name, feed in other_inputs.items():
        shapes = {k: list(v.shape) for k, v in feed.items() if hasattr(v, "shape")}
        try:
            expected = eager_outputs(model, feed)
        except Exception as exc:
            if not eager_may_refuse:
                raise
            checks.append(ShapeCheck(name, shapes, skipped=f"eager refuses it: {_first_line(exc)}"))
            continue
        try:
            got = run(feed)
        except Exception as exc:  # the runtime refused the shape: that is the finding, not an error of ours
            checks.append(ShapeCheck(name, shapes, problem=_first_line(exc)))
            continue
        if outputs is not None:
            expected, got = _select(expected, outputs), _select(got, outputs)
        checks.append(ShapeCheck(name, shapes, compare(expected, got, atol, rtol)))
    return checks


def _select(named: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """The outputs called `names`; a runtime that lost the names falls back to the first output."""
    picked = {n: named[n] for n in names if n in named}
    if not picked and named:
        picked = {names[0]: next(iter(named.values()))}
    return picked
