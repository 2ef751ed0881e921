"""What a quantized export costs in quality: the export against its float model on held-out text.

`quantization_accuracy(export, model)` runs a causal LM export (a saved folder, a loaded artifact, the components
of `export_for_generation`, or a single program in memory) in its own runtime on windows of held-out text, and
the float model on the same tokens, and returns an `AccuracyRecord`: perplexity of both, the mean KL divergence of
the next-token distributions, top-1 agreement, and the first step where greedy generation of the export leaves the
float model's. `export --validate` records it for every quantized export and fails when it exceeds the budget of
the recipe's precision (`BUDGETS`, docs/quantization.md).
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hfexport.artifacts.eval_text import heldout_python
from hfexport.artifacts.loaded import LoadedExport, load
from hfexport.core.errors import InputError
from hfexport.report import AccuracyRecord


@dataclass(frozen=True)
class AccuracyBudget:
    """The most a recipe may cost: perplexity's relative increase, and the least top-1 agreement."""

    perplexity_change: float
    top1_agreement: float

    def to_dict(self) -> dict[str, float]:
        return {"perplexity_change": self.perplexity_change, "top1_agreement": self.top1_agreement}


# By precision (`precision_of`). Measured on the code model fixture (docs/quantization.md, "Accuracy on a trained
# model"): each budget holds every recipe of its precision there, with room for other text and models.
BUDGETS: dict[str, AccuracyBudget] = {
    "int8-weights": AccuracyBudget(perplexity_change=0.01, top1_agreement=0.97),
    "int8": AccuracyBudget(perplexity_change=0.03, top1_agreement=0.93),
    "int4": AccuracyBudget(perplexity_change=0.10, top1_agreement=0.85),
}
# A float model whose perplexity exceeds this share of its vocabulary is near uniform (random or untrained
# weights; a trained model is orders of magnitude below): its figures say nothing about a recipe.
UNIFORM_SHARE = 0.1


def precision_from_settings(quantizer: str, settings: Mapping[str, Any]) -> str:
    """The precision class of a recipe ("int8", "int8-weights", "int4"), from its quantizer's class name and
    settings (`ExportQuantizer.settings()`, as the report records them)."""
    recipe = settings.get("recipe")
    if recipe == "NNCFWeightCompressionConfig":
        mode = str(settings.get("mode", "")).lower()
        return "int8-weights" if mode.startswith("int8") else "int4"
    bits = settings.get("weight_bits")
    if isinstance(bits, int) and bits <= 4:
        return "int4"
    return "int8"


def precision_of(quantizer: Any) -> str:
    """The precision class of a quantizer object (see `precision_from_settings`)."""
    return precision_from_settings(type(quantizer).__name__, quantizer.settings())


def _recorded_precision(loaded: LoadedExport) -> str | None:
    """The precision of the quantizer a loaded artifact's report records (any component's), or None."""
    reports = [loaded.report] + [c.report for c in loaded.components.values()]
    for report in reports:
        record = (report or {}).get("quantization")
        if record:
            return precision_from_settings(record.get("quantizer", ""), record.get("settings") or {})
    return None


# -- the tokens measured on ----------------------------------------------------------------------------------


@dataclass
class EvalTokens:
    """`windows` [n, length] of token ids, evenly spaced over the text, and where they came from."""

    windows: torch.Tensor
    description: str


def eval_tokens(
    text: str | None,
    tokenizer: Any,
    vocab_size: int,
    windows: int = 8,
    window: int = 128,
    description: str | None = None,
) -> EvalTokens:
    """`windows` windows of `window` tokens of `text` (default: `heldout_python()`), tokenized by `tokenizer`.

    Without a tokenizer (a built-in random model) the ids are the text's bytes modulo `vocab_size`: the figures
    of such a model are not meaningful anyway, and the record says so.
    """
    if text is None:
        text, description = heldout_python()
    description = description or f"{len(text) // 1000} KB of text"
    if tokenizer is None:
        ids = torch.tensor(list(text.encode()), dtype=torch.long) % vocab_size
        description += ", bytes as ids (no tokenizer)"
    else:
        ids = torch.as_tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    count = min(windows, len(ids) // window)
    if count < 1:
        raise InputError(f"the evaluation text has {len(ids)} tokens: fewer than one window of {window}")
    step = (len(ids) - window) // max(count - 1, 1)
    pieces = torch.stack([ids[i * step : i * step + window] for i in range(count)])
    return EvalTokens(pieces, f"{description}, {count} x {window} tokens")


# -- running the float model and the export ------------------------------------------------------------------


class _Runner:
    """Logits of full sequences (`[batch, length] -> [batch, length, vocab]`) and greedy continuations.

    `batch`: the batch the runner takes (None: any); `length`: the one sequence length it takes (None: any);
    `max_length`: the longest sequence it takes (a static cache).
    """

    batch: int | None = None
    length: int | None = None
    max_length: int | None = None
    greedy_refusal: str = ""

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def greedy(self, ids: torch.Tensor, new: int) -> torch.Tensor:
        """`new` greedy tokens after `ids` (argmax at every step, end-of-sequence ignored): `[batch, new]`."""
        sequence = ids
        for _ in range(new):
            token = self.logits(sequence)[:, -1].argmax(-1, keepdim=True)
            sequence = torch.cat([sequence, token], dim=-1)
        return sequence[:, ids.shape[1] :]


def _feed(names: list[str], ids: torch.Tensor) -> dict[str, torch.Tensor]:
    batch, length = ids.shape
    available = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "position_ids": torch.arange(length, dtype=torch.long)[None].expand(batch, -1).contiguous(),
        "token_type_ids": torch.zeros_like(ids),
    }
    missing = [name for name in names if name not in available]
    if missing:
        raise InputError(f"the export takes {missing} besides the token ids: measuring it needs a causal LM export")
    return {name: available[name] for name in names}


class FloatModel(_Runner):
    """The float (eager) model as the reference: `logits(ids)` of full sequences, `greedy(ids, new)` by argmax."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return self.model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits.float()


class _Single(_Runner):
    """One saved component (an `export()` artifact) in its runtime; greedy recomputes the growing sequence."""

    def __init__(self, loaded: LoadedExport, sample_inputs: Mapping[str, Any] | None) -> None:
        (self.component,) = loaded.components.values()
        self.names = [name for name in self.component.inputs if not name.startswith("output.")]
        sample = (sample_inputs or {}).get("input_ids")
        if sample is not None:
            self.batch = int(sample.shape[0])
        if (loaded.config or {}).get("dynamic") is False:
            if sample is None:
                raise InputError("a static export is measured at its traced shape: pass its sample_inputs")
            self.length = int(sample.shape[1])
            self.greedy_refusal = "static shapes: the export runs only its traced length, so it cannot generate"

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        outputs = self.component.run(_feed(self.names, ids))
        logits = outputs.get("logits", next(iter(outputs.values())))
        return torch.as_tensor(logits).float()


class _Components(_Runner):
    """`export_for_generation` components (in memory or loaded): the first graph on an empty cache gives a
    window's logits (`prompt_logits`); greedy tokens come from `generate`."""

    def __init__(self, components: Any) -> None:
        self.components = components
        spec = components.generation if isinstance(components, LoadedExport) else components.spec
        self.batch = spec.sample_batch or None
        self.max_length = spec.max_cache_len if spec.static_cache else None

    def logits(self, ids: torch.Tensor) -> torch.Tensor:
        from hfexport.runtime.generation import prompt_logits

        return torch.as_tensor(prompt_logits(self.components, ids)).float()

    def greedy(self, ids: torch.Tensor, new: int) -> torch.Tensor:
        from hfexport.runtime.generation import generate

        # No end-of-sequence token: every step is an argmax, as `_Runner.greedy` does for the float model.
        out = generate(self.components, ids, torch.ones_like(ids), max_new_tokens=new, eos_token_id=[])
        return out[:, ids.shape[1] :]


def _in_batches(run: Callable[[torch.Tensor], torch.Tensor], rows: torch.Tensor, batch: int | None) -> list:
    """`run` over `rows` in batches of exactly `batch` (the last one padded with repeats of its first row)."""
    if batch is None:
        return [(rows, run(rows))]
    results = []
    for start in range(0, len(rows), batch):
        chunk = rows[start : start + batch]
        padded = torch.cat([chunk, chunk[:1].expand(batch - len(chunk), -1)]) if len(chunk) < batch else chunk
        results.append((chunk, run(padded.contiguous())[: len(chunk)]))
    return results


# -- the measurement -----------------------------------------------------------------------------------------


@dataclass
class LogitComparison:
    """Sums over next-token predictions of the float model's logits (`want`) and an export's (`got`) on the same
    windows; `record` turns them into an `AccuracyRecord`. Windows can be added in any number of calls, so logits
    of a large vocabulary never need to be held all at once."""

    nll_float: float = 0.0
    nll_export: float = 0.0
    kl: float = 0.0
    agree: int = 0
    count: int = 0

    def add(self, ids: torch.Tensor, want: torch.Tensor, got: torch.Tensor) -> None:
        """Windows `ids` [n, length] and both models' logits on them [n, length, vocab]."""
        targets = torch.as_tensor(ids)[:, 1:].reshape(-1)
        want = torch.as_tensor(want)[:, :-1].reshape(-1, want.shape[-1]).double().log_softmax(-1)
        got = torch.as_tensor(got)[:, :-1].reshape(-1, got.shape[-1]).double().log_softmax(-1)
        self.nll_float -= want.gather(1, targets[:, None]).sum().item()
        self.nll_export -= got.gather(1, targets[:, None]).sum().item()
        self.kl += (want.exp() * (want - got)).sum().item()
        self.agree += int((want.argmax(-1) == got.argmax(-1)).sum())
        self.count += len(targets)

    def record(
        self,
        *,
        vocab_size: int,
        precision: str,
        text: str,
        greedy: tuple[torch.Tensor, torch.Tensor] | None = None,
        budget: AccuracyBudget | None = None,
        notes: list[str] | None = None,
    ) -> AccuracyRecord:
        """The record of the sums; `greedy`: the float model's and the export's greedy tokens [prompts, new]."""
        notes = list(notes or [])
        first = None
        if greedy is not None:
            differs = (torch.as_tensor(greedy[0]) != torch.as_tensor(greedy[1])).any(0).nonzero()
            first = int(differs[0]) if len(differs) else None
        float_ppl = _exp(self.nll_float / self.count)
        meaningful = float_ppl < UNIFORM_SHARE * vocab_size
        if not meaningful:
            notes.append(
                f"not meaningful: the float model's perplexity ({float_ppl:.0f}) is near uniform over its "
                f"{vocab_size} tokens (random or untrained weights), so these figures say nothing about the recipe"
            )
        chosen = budget or BUDGETS.get(precision)
        return AccuracyRecord(
            precision=precision,
            text=text,
            tokens=self.count,
            vocab_size=vocab_size,
            float_perplexity=float_ppl,
            perplexity=_exp(self.nll_export / self.count),
            kl_divergence=self.kl / self.count,
            top1_agreement=self.agree / self.count,
            greedy_tokens=0 if greedy is None else int(torch.as_tensor(greedy[0]).shape[1]),
            first_divergence=first,
            meaningful=meaningful,
            budget=chosen.to_dict() if chosen else None,
            notes=notes,
        )


def _open(export: Any, sample_inputs: Mapping[str, Any] | None, keep: list[Any]) -> tuple[_Runner, str | None]:
    """The runner of `export`, and the precision its manifest records (None: not recorded)."""
    if isinstance(export, (str, Path)):
        export = load(export, trust=True)  # the caller names a folder it wrote or trusts
    if isinstance(export, LoadedExport):
        precision = _recorded_precision(export)
        if export.generation is not None:
            return _Components(export), precision
        if len(export.components) != 1:
            raise InputError(f"an export of components {list(export.components)} without a generation layout")
        return _Single(export, sample_inputs), precision
    if hasattr(export, "spec") and hasattr(export, "samples"):
        return _Components(export), None
    # One program in memory: saved to a temporary folder and run from there, in its own runtime.
    from hfexport.artifacts.publish import save

    folder = tempfile.TemporaryDirectory(prefix="hfexport-accuracy-")
    keep.append(folder)
    save(export, Path(folder.name) / "export")
    return _Single(load(Path(folder.name) / "export", trust=True), sample_inputs), None


def _exp(value: float) -> float:
    return math.exp(value) if value < 700 else math.inf  # NaN stays NaN


def quantization_accuracy(
    export: Any,
    model: Any,
    *,
    tokenizer: Any = None,
    text: str | None = None,
    text_name: str | None = None,
    windows: int = 8,
    window: int = 128,
    greedy_prompt: int = 32,
    greedy_tokens: int = 32,
    sample_inputs: Mapping[str, Any] | None = None,
    quantizer: Any = None,
    precision: str | None = None,
    budget: AccuracyBudget | None = None,
) -> AccuracyRecord:
    """A causal LM `export` in its own runtime against the float `model` on held-out text: an `AccuracyRecord`.

    export: a saved folder, a loaded artifact (`hfexport.load`), `export_for_generation` components (in memory or
        loaded), or one program in memory (saved to a temporary folder to run it).
    tokenizer / text: the text measured on (default: held-out Python stdlib source, `heldout_python()`), cut into
        `windows` windows of `window` tokens, spread over it; `text_name` says where it came from.
    greedy_prompt / greedy_tokens: greedy generation from the first `greedy_prompt` tokens of the first windows
        (one per row of the export's batch), `greedy_tokens` new tokens, argmax at every step.
    sample_inputs: the export's traced sample (its batch; a static export runs only its traced length).
    precision / quantizer: which budget applies (`BUDGETS`; default: the quantizer's, else the one the artifact's
        report records); `budget` overrides it.
    """
    keep: list[Any] = []  # a temporary folder lives as long as the measurement
    runner, recorded = _open(export, sample_inputs, keep)
    eager = FloatModel(model)
    vocab = int(model.config.get_text_config().vocab_size)
    length = runner.length or min(window, runner.max_length or window)
    tokens = eval_tokens(text, tokenizer, vocab, windows, length, text_name)
    notes: list[str] = []
    try:
        batches = _in_batches(runner.logits, tokens.windows, runner.batch)
    except Exception as exc:
        # A program in memory records no config: one that refuses the windows may be static. Its traced shape
        # is then the only one it runs.
        sample = (sample_inputs or {}).get("input_ids")
        if not isinstance(runner, _Single) or runner.length is not None or sample is None:
            raise
        runner.length, length = int(sample.shape[1]), int(sample.shape[1])
        runner.greedy_refusal = f"it refused {window}-token windows ({type(exc).__name__}): static shapes?"
        tokens = eval_tokens(text, tokenizer, vocab, windows, length, text_name)
        batches = _in_batches(runner.logits, tokens.windows, runner.batch)
        notes.append(f"measured at the traced length ({length} tokens): {runner.greedy_refusal}")
    sums = LogitComparison()
    for chunk, got in batches:
        sums.add(chunk, eager.logits(chunk), got)

    greedy = None
    prompt = min(greedy_prompt, length)
    new = greedy_tokens if runner.max_length is None else min(greedy_tokens, runner.max_length - prompt)
    if runner.greedy_refusal:
        notes.append(f"greedy generation not measured: {runner.greedy_refusal}")
    elif new > 0:
        rows = runner.batch or 1
        prompts = tokens.windows[:rows, :prompt]
        if len(prompts) < rows:
            prompts = torch.cat([prompts, prompts[:1].expand(rows - len(prompts), -1)])
        prompts = prompts.contiguous()  # runtimes take dense inputs (a strided view fails ExecuTorch's check)
        greedy = (eager.greedy(prompts, new), runner.greedy(prompts, new))
    return sums.record(
        vocab_size=vocab,
        precision=precision or (precision_of(quantizer) if quantizer is not None else recorded) or "int8",
        text=tokens.description,
        greedy=greedy,
        budget=budget,
        notes=notes,
    )
