"""The corpus parity check of an exported artifact: the sample, then the shapes that find baked lengths.

An export traced on one sample can bake its length or batch in (a window mask built for 8 tokens, a chunk
count, a reshape to the traced batch). The sample alone never shows it; the grown input (+5 tokens) misses
what only breaks past a window or chunk boundary. This module runs the artifact on the sample and on every
shape of :meth:`CorpusEntry.shape_inputs` (grown, long, longer, batch+1) and compares the entry's main output
with eager, reusing ``export --validate``'s comparison (:func:`hfexport.artifacts.validation.check_shapes`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from hfexport.artifacts.validation import ShapeCheck, check_shapes
from hfexport.frontends.multimodal import image_counts, is_vision_tower, pixel_layouts
from hfexport.naming import named_outputs

from .corpus import CorpusEntry

__all__ = ["check_entry", "failures"]


def _named(outputs: Any) -> dict[str, Any]:
    return outputs if isinstance(outputs, dict) else named_outputs(outputs)


def check_entry(
    entry: CorpusEntry,
    model: Any,
    run: Callable[[Mapping[str, Any]], Any],
    tolerance: float,
    *,
    shapes: bool = True,
    image_count: Mapping[str, int] | None = None,
) -> list[ShapeCheck]:
    """The artifact (`run(feed)` -> named outputs or a model output) against eager `model` on the sample and,
    with `shapes`, on the entry's other shapes. Main output only, |diff| <= tolerance * max(1, max|eager|).

    The sample must run in eager (it is the reference); another shape that eager refuses (past what the
    model accepts) is a skipped check, since it says nothing about the artifact, and so is another image layout
    than the sample's that the artifact refuses (a pixel-input forward is exported for the sample's layout), and
    another image count where the export kept it static (`image_count`, the artifact's `used["image_count"]`:
    the forward makes one Python value per image).
    """
    feeds: dict[str, Mapping[str, Any]] = {"sample": entry.sample_inputs()}
    if shapes:
        feeds.update(entry.shape_inputs())
    checks = []
    tower = is_vision_tower(model)
    sample_layout = pixel_layouts(feeds["sample"], tower)
    for name, feed in feeds.items():
        # atol = rtol = tolerance gives tolerance * (1 + max|eager|): the corpus bound, max(1, ...), is tighter
        # only where max|eager| < 1, so compare with rtol alone and a floor of `tolerance`.
        (check,) = check_shapes(
            lambda f: _named(run(f)),
            model,
            {name: feed},
            atol=0.0,
            rtol=tolerance,
            outputs=[entry.output],
            eager_may_refuse=name != "sample",
        )
        for diff in check.outputs:
            diff.tolerance = max(diff.tolerance, tolerance)
        counts = image_counts(feed)
        other_count = any(counts.get(k, n) != n for k, n in (image_count or {}).items())
        if check.problem and (pixel_layouts(feed, tower) != sample_layout or other_count):
            # A pixel-input forward is exported for the sample's image layout (batch+1 cycles the images into
            # another grid list): refusing another one is the documented behaviour, a wrong answer stays a failure.
            what = "image count" if other_count else "image layout"
            check.skipped = f"another {what} than the sample's, refused: {check.problem}"
            check.problem = ""
        checks.append(check)
    return checks


def failures(checks: list[ShapeCheck]) -> list[str]:
    """One line per failed check, naming the shape: what a test asserts is empty."""
    lines = []
    for check in checks:
        if check.ok:
            continue
        shapes = ", ".join(f"{k} {v}" for k, v in check.shapes.items())
        detail = check.problem or "; ".join(
            o.problem or f"{o.name} max abs diff {o.max_abs_diff:.3g} > {o.tolerance:.3g}" for o in check.outputs
        )
        lines.append(f"{check.name} ({shapes}): {detail or 'no outputs'}")
    return lines
