"""`--validate` on a quantized export: the export against the float model on held-out text, gated by a budget.

A quantized export differs from eager by design, so the output-by-output tolerance of `--validate` cannot judge
it. Instead `quantization_accuracy` measures perplexity, KL divergence, top-1 agreement and greedy divergence on
`--eval-text` (default: held-out Python stdlib source), and the export fails when the recipe exceeds its
precision's budget (`hfexport.artifacts.accuracy.BUDGETS`, or `--max-perplexity-increase`).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from hfexport.cli.exits import UsageError


def _tokenizer(spec: str, trust_remote_code: bool) -> Any:
    """The folder model's tokenizer, or None (a built-in random model: the text's bytes stand in for ids)."""
    from hfexport.tiny import TINY_MODELS

    if spec in TINY_MODELS:
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(spec, local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return None


def text_and_tokenizer(args: argparse.Namespace) -> tuple[str | None, str | None, Any]:
    """(`--eval-text`'s text or None for the default, its name, the model's tokenizer or None)."""
    text = name = None
    if args.eval_text:
        try:
            text = Path(args.eval_text).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise UsageError(f"--eval-text {args.eval_text}: cannot read it as text ({exc})") from None
        name = Path(args.eval_text).name
    return text, name, _tokenizer(args.model, args.trust_remote_code)


def measure(args: argparse.Namespace, model: Any, export: Any, inputs: dict[str, Any], config: Any) -> Any:
    """The `AccuracyRecord` of a quantized `export` (a saved folder or components) against the float `model`, or
    None when the config has no quantizer."""
    quantizer = getattr(config, "quantizer", None)
    if quantizer is None:
        return None
    from hfexport.artifacts.accuracy import BUDGETS, AccuracyBudget, precision_of, quantization_accuracy

    text, name, tokenizer = text_and_tokenizer(args)
    budget = None
    if args.max_perplexity_increase is not None:
        default = BUDGETS[precision_of(quantizer)]
        budget = AccuracyBudget(args.max_perplexity_increase / 100, default.top1_agreement)
    return quantization_accuracy(
        export,
        model,
        tokenizer=tokenizer,
        text=text,
        text_name=name,
        sample_inputs=inputs,
        quantizer=quantizer,
        budget=budget,
    )


def runs_everywhere(validation: Any) -> bool:
    """Whether a quantized artifact ran on every input `--validate` gave it (its values are the accuracy's to
    judge): no output missing or misshapen, no other shape refused."""
    outputs = bool(validation.outputs) and not any(o.problem for o in validation.outputs)
    return outputs and not any(c.problem for c in validation.checks)


def accuracy_lines(record: Any) -> list[str]:
    """What `--validate` prints of a quantized export's `AccuracyRecord`."""
    lines = [f"accuracy against the float model ({record.text}, {record.tokens} predictions):", f"  {record.summary()}"]
    return lines + [f"  note: {note}" for note in record.notes]
