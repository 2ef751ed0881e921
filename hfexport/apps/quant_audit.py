"""Which layers a quantization recipe hurts: per-group attribution of its error, and the gain of keeping the worst
groups in floating point (`hfexport audit --quant`).

`audit_quantization` exports a causal LM with the config's quantizer once as is, then once per linear group with
only that group quantized (every other group in `ExportQuantizer.keep_float`), and measures each export against
the float model with `quantization_accuracy`: the mean KL divergence a group adds alone ranks the groups. Then it
exports once more with the `keep_worst` worst groups in `keep_float` (mixed precision) and reports the gain.
A group is a module whose children are the linears it holds: each decoder block's attention and MLP, and the
embedding and head on their own (`linear_groups`).

What is NNCF's and what is ours: NNCF ranks weights for int4/int8 mixed precision itself
(`NNCFWeightCompressionConfig(ratio=..., sensitivity_metric=...)`, from weight or activation statistics, without
measuring the model's output), and excludes nodes by name (`ignored_scope`). The measured attribution (each group's
error on held-out text, in its runtime) and `keep_float` by module name on every quantizer (NNCF through
`ignored_scope`, ONNX Runtime through `nodes_to_exclude`, PT2E by dropping annotations) are hfexport's.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hfexport.report import AccuracyRecord

Progress = Callable[[str], None]


@dataclass
class GroupError:
    """One group quantized alone (every other group kept in floating point), against the float model."""

    group: str
    linears: int
    accuracy: AccuracyRecord | None = None
    error: str = ""

    @property
    def kl(self) -> float:
        return self.accuracy.kl_divergence if self.accuracy is not None else float("inf")

    def to_dict(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "linears": self.linears,
            "accuracy": self.accuracy.to_dict() if self.accuracy else None,
            "error": self.error,
        }


@dataclass
class QuantAudit:
    """The recipe's error, by group, worst first, and the mixed-precision export that keeps the worst in float."""

    recipe: str
    export_format: str
    full: AccuracyRecord
    groups: list[GroupError] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    mixed: AccuracyRecord | None = None
    seconds: float = 0.0

    @property
    def ranking(self) -> list[str]:
        """The groups, worst (largest KL added alone) first."""
        return [g.group for g in self.groups]

    def to_dict(self) -> dict[str, Any]:
        return {
            "recipe": self.recipe,
            "export_format": self.export_format,
            "full": self.full.to_dict(),
            "groups": [g.to_dict() for g in self.groups],
            "kept": list(self.kept),
            "mixed": self.mixed.to_dict() if self.mixed else None,
            "seconds": round(self.seconds, 1),
        }

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_dict(), indent=2))
        return path

    def render(self) -> str:
        full = self.full
        lines = [
            f"quantization audit: {self.recipe} on {self.export_format} ({full.text})",
            f"  whole recipe: {full.summary()}",
            "  error each group adds when quantized alone (the rest in float), worst first:",
        ]
        rows = [("group", "linears", "KL", "perplexity", "top-1")]
        for g in self.groups:
            if g.accuracy is None:
                rows.append((g.group, str(g.linears), "failed", g.error[:60], ""))
                continue
            a = g.accuracy
            share = f" ({a.kl_divergence / full.kl_divergence:.0%})" if full.kl_divergence > 0 else ""
            rows.append(
                (
                    g.group,
                    str(g.linears),
                    f"{a.kl_divergence:.5f}{share}",
                    f"{a.perplexity_change:+.2%}",
                    f"{a.top1_agreement:.2%}",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines += ["    " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
        if self.mixed is not None:
            gain = 1 - self.mixed.kl_divergence / full.kl_divergence if full.kl_divergence > 0 else 0.0
            lines.append(f"  keep_float={self.kept}: {self.mixed.summary()}")
            lines.append(
                f"  gain: KL {full.kl_divergence:.5f} -> {self.mixed.kl_divergence:.5f} ({gain:.0%} less), perplexity "
                f"{full.perplexity_change:+.2%} -> {self.mixed.perplexity_change:+.2%}"
            )
        if not full.meaningful:
            lines.append("  note: the float model is near uniform on this text; the ranking says nothing")
        lines.append(f"  ({len(self.groups) + 1 + (self.mixed is not None)} exports in {self.seconds:.0f}s)")
        return "\n".join(lines)


def linear_groups(model: Any) -> dict[str, int]:
    """{group module name: linears in it}, in module order: the parent of each `nn.Linear` (a decoder block's
    attention, its MLP), and a linear or embedding directly under the model or its base model (the head, the
    token embedding) as a group of its own."""
    import torch

    modules = dict(model.named_modules())
    base = getattr(model, "base_model_prefix", "")
    groups: dict[str, int] = {}
    for name, module in modules.items():
        if not isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) or not name:
            continue
        parent = name.rpartition(".")[0]
        group = name if parent in ("", base) or isinstance(module, torch.nn.Embedding) else parent
        groups[group] = groups.get(group, 0) + 1
    return groups


def _recipe(quantizer: Any) -> str:
    settings = quantizer.settings()
    detail = ", ".join(f"{k}={v}" for k, v in settings.items() if v not in (None, (), [], {}) and k != "recipe")
    return f"{type(quantizer).__name__}({settings.get('recipe', '')}{': ' if detail else ''}{detail})"


def audit_quantization(
    model: Any,
    inputs: Mapping[str, Any],
    config: Any,
    *,
    tokenizer: Any = None,
    text: str | None = None,
    text_name: str | None = None,
    groups: Sequence[str] | None = None,
    keep_worst: int = 2,
    generation: bool = False,
    measure: Mapping[str, Any] | None = None,
    progress: Progress | None = None,
) -> QuantAudit:
    """Rank the linear groups of `model` by the error `config.quantizer` adds in each, alone; then measure the
    export with the `keep_worst` worst groups kept in floating point.

    groups: module names (default: `linear_groups(model)`). generation: measure `export_for_generation`
    components instead of one `export()` program. measure: extra keyword arguments of `quantization_accuracy`
    (windows, window, greedy_tokens...). Each export runs in its own runtime; `len(groups) + 2` exports in all.
    """
    from hfexport.artifacts.accuracy import quantization_accuracy
    from hfexport.auto import AutoHfExporter

    quantizer = config.quantizer
    if quantizer is None:
        raise ValueError("audit_quantization needs a config with a quantizer")
    found = linear_groups(model)
    names = list(groups) if groups is not None else list(found)
    say = progress or (lambda message: None)
    started = time.perf_counter()

    def measured(keep: Sequence[str]) -> AccuracyRecord:
        variant = copy.copy(quantizer)
        variant.keep_float = tuple(keep)
        variant_config = copy.copy(config)
        variant_config.quantizer = variant
        exporter = AutoHfExporter.from_config(variant_config)
        if generation:
            result = exporter.export_for_generation(model, inputs, variant_config)
        else:
            result = exporter.export(model, inputs, config=variant_config)
        return quantization_accuracy(
            result,
            model,
            tokenizer=tokenizer,
            text=text,
            text_name=text_name,
            sample_inputs=inputs,
            quantizer=quantizer,
            **dict(measure or {}),
        )

    say(f"exporting with {_recipe(quantizer)} (every group quantized)")
    full = measured(())
    errors = []
    for index, group in enumerate(names):
        say(f"[{index + 1}/{len(names)}] only {group} quantized")
        try:
            record = measured([other for other in names if other != group])
            errors.append(GroupError(group, found.get(group, 0), record))
        except Exception as exc:  # a group the toolkit cannot quantize alone: shown, not fatal
            errors.append(GroupError(group, found.get(group, 0), error=f"{type(exc).__name__}: {exc}"))
    errors.sort(key=lambda g: -g.kl)
    kept = [g.group for g in errors if g.accuracy is not None][: max(keep_worst, 0)]
    mixed = None
    if kept:
        say(f"exporting with keep_float={kept}")
        mixed = measured(kept)
    return QuantAudit(
        recipe=_recipe(quantizer),
        export_format=str(getattr(config, "export_format", "")),
        full=full,
        groups=errors,
        kept=kept,
        mixed=mixed,
        seconds=time.perf_counter() - started,
    )
