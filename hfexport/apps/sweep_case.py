"""One case of `hfexport sweep`, in its own process (`python -m hfexport.apps.sweep_case`, or a Ray task): `child`
builds one corpus entry and exports, saves, loads and compares it with eager, or with `--generation`
(`generation_case`) exports it for generation and compares `hfexport.runtime.generate` with the model's own
`generate`. The row comes back as a dict (a `hfexport.apps.sweep.SweepRow`'s fields), also on failure.

A generation case: decompose and export with `dynamic=True` (a growing cache, or with `static` slots a static cache
and one multi-token decode graph), then generate `NEW_TOKENS` greedy tokens from a left-padded batch of 2 and
compare them with the model's own `generate` (same cache kind): `ok` means every token is equal. When the model's
own `generate` fails on the padded prompt (GLM-4V's multimodal rope index), both sides run unpadded and the row says
so (`unpadded`). Encoder-decoder, speech and vision-language entries drop the entry's `generate_exclude` inputs,
give `input_ids`/`attention_mask` as the prompt and every other input (pixel_values, input_features,
image_grid_thw...) as `encoder_inputs`. CTC entries have no generate loop and are reported `not-generative`.
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hfexport.backends.registry import backend

NEW_TOKENS = 8
# The key of a case's settings that makes it a generation case (`GenerationCheck.to_dict()`).
GENERATION = "generation"
_IMAGE_TOKENS = ("image_token_id", "image_token_index", "video_token_id")


@dataclass(frozen=True)
class GenerationCheck:
    """What a generation case checks: `static` > 0 exports a static cache of that many slots (and a multi-token
    decode graph), 0 a dynamic cache."""

    static: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {"static": self.static}


def _padded_mask(model: Any, prompt: Any, mask: Any, others: dict[str, Any], row: dict[str, Any]) -> Any:
    """`mask` with the second row's first two tokens padded, unless they are image tokens (then unpadded)."""
    import torch

    if mask is None or mask.shape[0] < 2 or prompt is None:
        return mask
    types = others.get("mm_token_type_ids")
    special = {getattr(model.config, name, None) for name in _IMAGE_TOKENS}
    text_head = (
        not bool(types[1, :2].any()) if torch.is_tensor(types) else not any(int(t) in special for t in prompt[1, :2])
    )
    if not text_head:
        row["unpadded"] = True  # masking image tokens would cut an image, not pad the prompt
        return mask
    mask = mask.clone()
    mask[1, :2] = 0  # left padding on the second row: masks and positions must follow it
    return mask


def generation_case(
    entry: Any, export_format: str, settings: dict[str, Any], check: GenerationCheck, row: dict
) -> None:
    """Fill `row` (a sweep row as a dict, its `status` saying how far the case got) for one corpus entry."""
    import torch
    from transformers import GenerationConfig

    from hfexport.auto import AutoExportConfig, AutoHfExporter
    from hfexport.runtime.generation import generate

    model = entry.build_model()
    if not hasattr(model, "generate") or "CTC" in entry.auto_class:
        row["status"] = "not-generative"  # a CTC head decodes frames, it has no generate loop
        return
    exclude = set(entry.sample.get("generate_exclude", []))  # forward-only inputs (decoder_input_ids)
    sample = {k: v for k, v in entry.sample_inputs().items() if k not in exclude}
    others = {k: v for k, v in entry.grown_inputs().items() if k not in exclude}
    static = GenerationConfig(cache_implementation="static", max_cache_len=check.static) if check.static else None
    prompt = others.pop("input_ids", None)
    mask = others.pop("attention_mask", None)
    if mask is None and prompt is not None:
        mask = torch.ones_like(prompt)
    mask = _padded_mask(model, prompt, mask, others, row)
    config = copy.deepcopy(static or model.generation_config)
    config.max_new_tokens = config.min_new_tokens = NEW_TOKENS
    config.do_sample, config.num_beams = False, 1
    if config.pad_token_id is None:
        config.pad_token_id = 0
    feed = {**others, **({"input_ids": prompt} if prompt is not None else {})}
    if mask is not None:
        feed["attention_mask"] = mask
    try:
        with torch.no_grad():
            expected = model.generate(**feed, generation_config=config)
    except Exception:
        if mask is None or bool(mask.all()):
            raise
        # Some models' own generate fails on a left-padded multimodal prompt (GLM-4V's rope index): both sides
        # run without padding instead, and the row says so.
        mask = feed["attention_mask"] = torch.ones_like(mask)
        row["unpadded"] = True
        with torch.no_grad():
            expected = model.generate(**feed, generation_config=config)
    row["status"] = "export-error"
    export_config = AutoExportConfig.from_dict({"export_format": export_format, "dynamic": True, **settings})
    exporter = AutoHfExporter.from_config(export_config)
    start = time.perf_counter()
    try:
        components = exporter.export_for_generation(
            model, sample, export_config, generation_config=static, multi_token_decode=bool(check.static)
        )
    finally:
        hits: dict[str, int] = {}
        for report in (getattr(exporter, "reports", None) or {}).values():
            for stage in report.hits.values():
                for rule, count in stage.items():
                    hits[rule] = hits.get(rule, 0) + count
        row["hits"] = hits
    row["export_s"] = round(time.perf_counter() - start, 2)
    row["components"] = list(components)
    row["status"] = "generate-error"
    got = generate(
        components,
        prompt,
        mask,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        pad_token_id=config.pad_token_id,
        encoder_inputs=others,
    )
    width = expected.shape[1] - NEW_TOKENS  # the prompt (decoder-only) or the decoder start (encoder-decoder)
    new_expected, new_got = expected[:, width:], got[:, width:]
    agree = (new_expected == new_got).float().mean().item() if new_got.shape == new_expected.shape else 0.0
    row["tokens_differ"] = 1.0 - agree
    row["status"] = "ok" if got.shape == expected.shape and torch.equal(got, expected) else "token-mismatch"


def child(path: str, export_format: str, config_json: str) -> dict[str, Any]:
    """Export, save, load and run one corpus entry; the row as a dict (also on failure). `config_json` holds the
    export config fields, and under `GENERATION` the settings of a generation case."""
    import torch

    from hfexport.artifacts import load, save
    from hfexport.auto import AutoExportConfig, AutoHfExporter
    from hfexport.testing.corpus import load_entry
    from hfexport.testing.corpus_check import check_entry, failures

    row: dict[str, Any] = {"model": Path(path).stem, "status": "invalid-config"}
    # Relative to max(1, max|eager|), the backend's (`Backend.tolerance`).
    tolerance = backend(export_format).tolerance
    exporter = None
    try:
        entry = load_entry(path)
        row["model"], row["model_type"] = entry.name, entry.model_type
        row["status"] = "eager-error"
        settings = json.loads(config_json)
        generation = settings.pop(GENERATION, None)
        if generation is not None:
            generation_case(entry, export_format, settings, GenerationCheck(**generation), row)
            return row
        model = entry.build_model()
        inputs = entry.sample_inputs()
        with torch.no_grad():
            model(**inputs)  # the sample must run in eager: it is every check's reference
        row["status"] = "export-error"
        config = AutoExportConfig.from_dict({"export_format": export_format, "dynamic": True, **settings})
        exporter = AutoHfExporter.from_config(config)
        start = time.perf_counter()
        program = exporter.export(model, inputs, config=config)
        row["export_s"] = round(time.perf_counter() - start, 2)
        with tempfile.TemporaryDirectory(prefix="hfexport-sweep-") as tmp:
            row["status"] = "save-error"
            save(program, Path(tmp) / "artifact", config=config, report=exporter.report)
            row["status"] = "load-error"
            loaded = load(Path(tmp) / "artifact", trust=True)  # we wrote it a moment ago
            row["status"] = "check-error"
            # The sample, then the shapes that find baked lengths: grown, long, longer (past windows and
            # chunks) and another batch, compared as the corpus tests and `export --validate` do.
            component = next(iter(loaded.components.values()))
            checks = check_entry(entry, model, loaded.run, tolerance, image_count=component.image_count)
            diffs = [o for c in checks for o in c.outputs if not o.problem]
            row["max_abs_diff"] = max((o.max_abs_diff for o in diffs), default=0.0)
            row["tolerance"] = max((o.tolerance for o in diffs), default=tolerance)
            row["shapes"] = [c.name for c in checks if not c.skipped]
            failed = [c for c in checks if not c.ok]
            if failed:
                first = failed[0]
                broke = first.problem or any(o.problem for o in first.outputs)
                row["status"] = f"{first.name}-{'run-error' if broke else 'mismatch'}"
                row["error"] = "; ".join(failures(failed))[:400]
                return row
            row["status"] = "ok"
    except Exception as exc:
        text = " ".join(str(exc).split())
        row["error"] = f"{type(exc).__name__}: {text[:400]}"
    finally:
        if exporter is not None and exporter.report is not None:
            row["hits"] = {k: v for stage in exporter.report.hits.values() for k, v in stage.items()}
    return row


def quiet_child() -> None:
    """A case's process prints nothing but its row: third-party warnings and logs would bury it."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)


if __name__ == "__main__":
    if len(sys.argv) == 4:
        quiet_child()
        print("ROW " + json.dumps(child(sys.argv[1], sys.argv[2], sys.argv[3])), flush=True)
        raise SystemExit(0)
    raise SystemExit("usage: python -m hfexport.apps.sweep_case ENTRY.json FORMAT CONFIG_JSON (use `hfexport sweep`)")
