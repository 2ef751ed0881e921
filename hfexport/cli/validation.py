"""`hfexport export --validate`: the saved artifact against eager, and what the command does with the verdict.

One behaviour for every way a validation can end (docs/cli.md, "When a validation fails"): the artifact stays
where it was saved, its manifest records the verdict (`validation.ok`, and `validation.error` when the check
itself could not run), the command says where the artifact is and that `--overwrite` replaces it, and exits 1.
A validation never ends as success unless it ran and every comparison passed.
"""

from __future__ import annotations

import argparse
import copy
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfexport.cli.exits import ExitCode

# The default tolerance of `--validate` relative to each output's largest eager value, by the precision the
# artifact computes in. float32 graphs differ from eager by reordered sums (~1e-5 relative); float16 weights
# (OpenVINO's saved default, or a float16 checkpoint) round each weight to 11 bits (~1e-3 relative on an output);
# bfloat16 keeps 8 bits, and a runtime that fuses or reorders bfloat16 arithmetic differently from eager lands a
# step or two of bfloat16 (2^-8 = 0.4 % each) away: tiny-llama in bfloat16 on ONNX Runtime, 0.002 on logits of
# scale 0.46 (one step); the tolerance allows five.
DEFAULT_ATOL = 1e-4
_RTOL = {"float32": 1e-3, "float16": 1e-2, "bfloat16": 2e-2}


@dataclass(frozen=True)
class Tolerance:
    """`--validate`'s tolerance, `|diff| <= atol + rtol * max|eager|`, and where it came from."""

    atol: float
    rtol: float
    source: str


def validation_tolerance(args: argparse.Namespace, config: Any, model: Any) -> Tolerance:
    """`--atol`/`--rtol` where given; otherwise the default for the precision the artifact computes in: the
    weights' dtype, or float16 where OpenVINO compresses float32 weights to it."""
    dtype = _weights_dtype(model)
    precision = dtype
    if dtype == "float32" and getattr(config, "compress_to_fp16", False):
        precision = "float16"
    rtol = _RTOL.get(precision, _RTOL["float32"])
    what = f"{dtype} weights" + (", saved as float16" if precision != dtype else "")
    given = [flag for flag in ("atol", "rtol") if getattr(args, flag, None) is not None]
    source = f"the default for {what}"
    if given:
        source = " and ".join(f"--{flag}" for flag in given) + (f"; the default for {what}" if len(given) < 2 else "")
    return Tolerance(
        args.atol if args.atol is not None else DEFAULT_ATOL, args.rtol if args.rtol is not None else rtol, source
    )


def _weights_dtype(model: Any) -> str:
    """The dtype of the model's floating-point weights (the most common one), as torch names it."""
    counts: dict[str, int] = {}
    for parameter in model.parameters():
        if parameter.is_floating_point():
            name = str(parameter.dtype).removeprefix("torch.")
            counts[name] = counts.get(name, 0) + parameter.numel()
    return max(counts, key=counts.__getitem__) if counts else "float32"


def crashed(exc: BaseException) -> dict[str, Any]:
    """The manifest's record of a validation that could not run: failed, with the error that stopped it."""
    first = (str(exc).strip().splitlines() or [""])[0][:500]
    return {"ok": False, "error": f"{type(exc).__name__}: {first}".rstrip(": ")}


def conclude(output: Path, validation: Mapping[str, Any], debug_exc: BaseException | None = None) -> int:
    """Say how the validation ended and return the exit code: 0 when it passed; otherwise the reason on stderr,
    where the artifact is kept (marked failed in its manifest) and how to replace it, and `ExitCode.DIFFERS`."""
    if validation.get("ok"):
        return int(ExitCode.OK)
    if debug_exc is not None:
        import traceback

        traceback.print_exception(debug_exc, file=sys.stderr)
    error = validation.get("error")
    reason = f"could not run: {error}" if error else "the artifact differs from eager beyond the tolerance"
    if error is None and "agreement" in validation:
        reason = "the generated tokens differ from model.generate"
    accuracy = validation.get("accuracy")
    if error is None and accuracy is not None:
        exceeded = "; ".join(accuracy.get("exceeded") or [])
        reason = (
            f"the quantized export is beyond its accuracy budget ({exceeded})"
            if exceeded
            else "the quantized export did not run on every input"
        )
    print(f"validation failed: {reason}", file=sys.stderr)
    print(
        f"the artifact is kept in {output}/ with its manifest saying validation failed (`hfexport check` reports "
        "it); export again with --overwrite to replace it",
        file=sys.stderr,
    )
    return int(ExitCode.DIFFERS)


def split_generation_inputs(inputs: Mapping[str, Any]) -> tuple[Any, Any, dict[str, Any]]:
    """(input_ids, attention_mask, encoder_inputs) of the sample inputs, as `hfexport.runtime.generate` takes them.

    A decoder-only model: its ids and mask, and the modality inputs (pixel_values...) as `encoder_inputs`. An
    encoder-decoder: what feeds the encoder (ids and mask, or a speech model's `input_features`), without the
    decoder's own inputs, which generation starts from the decoder start token.
    """
    rest = {k: v for k, v in inputs.items() if not k.startswith("decoder_")}
    ids, mask = rest.pop("input_ids", None), rest.pop("attention_mask", None)
    return ids, mask, rest


def check_generation(
    output: Path,
    model: Any,
    inputs: Mapping[str, Any],
    programs: Any,
    generation_config: Any,
    new_tokens: int,
    step: Callable[[str], Any],
) -> tuple[dict[str, Any], list[str]]:
    """`--generation --validate`: the saved artifact loaded back, every component run on the inputs recorded for
    it, and `new_tokens` greedy tokens of `hfexport.runtime.generate` over the loaded artifact compared with
    `model.generate` on the same inputs and cache kind. Returns the manifest record and the lines to print.

    The new tokens are compared: transformers' Whisper `generate` returns the tokens after the decoder prompt,
    other models the prompt (or the decoder start token) too.
    """
    import torch

    from hfexport.artifacts import load
    from hfexport.runtime.generation import generate

    step("validating: each saved component loads and runs on its recorded inputs")
    loaded = load(output, trust=True)  # written by this process a moment ago
    ran = {}
    for name in loaded.components:
        outputs = loaded.run(programs.samples[name], name)
        ran[name] = all(bool(torch.isfinite(t).all()) for t in outputs.values() if t.is_floating_point())
    ids, mask, encoder_inputs = split_generation_inputs(inputs)
    step(f"validating: {new_tokens} greedy tokens of the saved artifact against model.generate")
    reference = generation_config or copy.deepcopy(model.generation_config)
    reference.max_new_tokens = reference.min_new_tokens = new_tokens
    reference.do_sample = False
    eager_inputs = {
        k: v for k, v in {"input_ids": ids, "attention_mask": mask, **encoder_inputs}.items() if v is not None
    }
    with torch.no_grad():  # the same cache kind as the export
        want = model.generate(**eager_inputs, generation_config=reference)
    got = generate(
        loaded,
        ids,
        mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        encoder_inputs=encoder_inputs or None,
    )
    rows = want.shape[0]
    comparable = got.shape[0] == rows and min(got.shape[1], want.shape[1]) >= new_tokens
    agree = (got[:, -new_tokens:] == want[:, -new_tokens:]) if comparable else None
    agreement = float(agree.float().mean()) if agree is not None else 0.0
    validation = {
        "ok": agree is not None and bool(agree.all()) and all(ran.values()),
        "components_run": ran,
        "new_tokens": new_tokens,
        "agreement": agreement,
    }
    lines = [
        f"components run from the saved artifact: {ran}",
        f"greedy tokens vs model.generate: {agreement:.0%} of {new_tokens} x {rows} agree",
    ]
    return validation, lines
