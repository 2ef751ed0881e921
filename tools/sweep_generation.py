"""Generation sweep: export_for_generation on every corpus entry, then generate() against `model.generate`.

    python tools/sweep_generation.py --format onnx --family causal_lm --jobs 1 --out sweep_gen.md
    python tools/sweep_generation.py --format dynamo --static 64   # static cache + multi-token decode

Each model runs in its own subprocess. For each: decompose and export with `dynamic=True` (a growing cache,
or with `--static N` a static cache of N slots and one multi-token decode graph), then generate 8 greedy
tokens with `hfexport.runtime.generate` from a left-padded prompt and compare them with the model's own
`generate` (same cache kind). `ok` means every token is equal. When the model's own `generate` fails on the
padded prompt (GLM-4V's multimodal rope index), both sides run unpadded and the row says `unpadded`.

Encoder-decoder, speech and vision-language entries (`--family seq2seq|speech|vlm`) drop the entry's
`generate_exclude` inputs, give `input_ids`/`attention_mask` as the prompt and every other input
(pixel_values, input_features, image_grid_thw...) as `encoder_inputs`. CTC entries have no generate loop and
are reported `not-generative`.
"""

from __future__ import annotations

import sys

from sweep import _CHILD_HEAD, _CHILD_TAIL, run_sweep  # tools/ is on sys.path when this script runs

_CHILD = (
    _CHILD_HEAD
    + r"""
import copy
from transformers import GenerationConfig
from hfexport import AutoExportConfig, AutoHfExporter
from hfexport.runtime.generation import generate

entry = load_entry(sys.argv[1])
fmt, static = sys.argv[2], int(sys.argv[3])
row = {"model": entry.model_type, "status": "eager-error"}
tmp = tempfile.mkdtemp()
NEW = 8
try:
    model = entry.build_model()
    if not hasattr(model, "generate") or "CTC" in entry.auto_class:
        row["status"] = "not-generative"  # a CTC head decodes frames, it has no generate loop
        raise SystemExit(0)
    exclude = set(entry.sample.get("generate_exclude", []))  # forward-only inputs (decoder_input_ids)
    sample = {k: v for k, v in entry.sample_inputs().items() if k not in exclude}
    grown = {k: v for k, v in entry.grown_inputs().items() if k not in exclude}
    generation_config = GenerationConfig(cache_implementation="static", max_cache_len=static) if static else None
    prompt = grown.pop("input_ids", None)
    mask = grown.pop("attention_mask", None)
    if mask is None and prompt is not None:
        mask = torch.ones_like(prompt)
    if mask is not None and mask.shape[0] > 1 and prompt is not None:
        types = grown.get("mm_token_type_ids")
        special = {getattr(model.config, n, None) for n in ("image_token_id", "image_token_index", "video_token_id")}
        if torch.is_tensor(types):
            text_head = not bool(types[1, :2].any())
        else:
            text_head = not any(int(t) in special for t in prompt[1, :2])
        if text_head:
            mask = mask.clone()
            mask[1, :2] = 0  # left padding on the second row: masks and positions must follow it
        else:
            row["unpadded"] = True  # masking image tokens would cut an image, not pad the prompt
    # The other inputs (pixel_values, input_features, image_grid_thw...) go to the encoders.
    others = grown
    config = copy.deepcopy(generation_config or model.generation_config)
    config.max_new_tokens = config.min_new_tokens = NEW
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
        # Some models' own generate fails on a left-padded multimodal prompt (GLM-4V's rope index); compare
        # them without padding instead, and say so in the row.
        mask = torch.ones_like(mask)
        feed["attention_mask"] = mask
        row["unpadded"] = True
        with torch.no_grad():
            expected = model.generate(**feed, generation_config=config)
    row["status"] = "export-error"
    export_config = AutoExportConfig.from_dict({"export_format": fmt, "dynamic": True})
    exporter = AutoHfExporter.from_config(export_config)
    start = time.perf_counter()
    components = exporter.export_for_generation(
        model, sample, export_config, generation_config=generation_config, multi_token_decode=bool(static)
    )
    row["export_s"] = round(time.perf_counter() - start, 2)
    row["components"] = list(components)
    row["rules"] = {}
    for report in exporter.reports.values():
        for stage in report.hits.values():
            for rule, hits in stage.items():
                row["rules"][rule] = row["rules"].get(rule, 0) + hits
    row["status"] = "generate-error"
    got = generate(
        components, prompt, mask, max_new_tokens=NEW, min_new_tokens=NEW, pad_token_id=config.pad_token_id,
        encoder_inputs=others,
    )
    width = expected.shape[1] - NEW  # the prompt (decoder-only) or the decoder start (encoder-decoder)
    new_expected, new_got = expected[:, width:], got[:, width:]
    agree = (new_expected == new_got).float().mean().item() if new_got.shape == new_expected.shape else 0.0
    row["sample_diff"] = 1.0 - agree  # fraction of new tokens that differ
    row["status"] = "ok" if got.shape == expected.shape and torch.equal(got, expected) else "token-mismatch"
"""
    + _CHILD_TAIL
)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    static = "0"
    if "--static" in argv:
        at = argv.index("--static")
        static = argv[at + 1]
        del argv[at : at + 2]
    return run_sweep(argv, _CHILD, "generation", child_args=[static])


if __name__ == "__main__":
    raise SystemExit(main())
