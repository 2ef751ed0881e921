"""A generation case of `hfexport sweep --generation`: `export_for_generation` on one corpus entry, then
`hfexport.runtime.generate` against the model's own `generate`.

Decompose and export with `dynamic=True` (a growing cache, or with `static` slots a static cache and one
multi-token decode graph), then generate `NEW_TOKENS` greedy tokens from a left-padded batch of 2 and compare them
with the model's own `generate` (same cache kind): `ok` means every token is equal. When the model's own
`generate` fails on the padded prompt (GLM-4V's multimodal rope index), both sides run unpadded and the row says
so (`unpadded`). Encoder-decoder, speech and vision-language entries drop the entry's `generate_exclude` inputs,
give `input_ids`/`attention_mask` as the prompt and every other input (pixel_values, input_features,
image_grid_thw...) as `encoder_inputs`. CTC entries have no generate loop and are reported `not-generative`.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from typing import Any

NEW_TOKENS = 8
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
