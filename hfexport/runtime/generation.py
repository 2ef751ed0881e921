"""`generate()` over the components of `export_for_generation`, on any backend, with one call contract.

The loop is the same for every backend; a *driver* runs one component on one step and keeps the cache:

| backend | driver (`hfexport.runtime.drivers.<backend>`) | cache between steps |
|---|---|---|
| dynamo | `DynamoDriver` | the transformers `Cache` object; a static cache is mutated in place by the program |
| onnx | `OnnxDriver` | ONNX Runtime IO binding: each `input.<name>`/`output.<name>` pair double-buffered (no copies) |
| openvino | `OpenVINODriver` | numpy arrays by name, fed back from the outputs |
| executorch | `ExecutorchDriver` | tensors by name, read back from the method outputs (C++ zero-copy: docs) |

The backend is `hfexport.formats.format_of` of the components (or the format a loaded artifact records);
the next token is chosen in `hfexport.runtime.sampling`. One driver is kept per live components object
(`hfexport.runtime.generation_session`), never on the object itself, so sessions and compiled models are reused
across calls.

Two shapes of export are driven: a `prefill` + `decode` pair, or (static cache with multi-token decode)
the `decode` graph alone, which takes the whole prompt on an empty cache and then one token a step.
Masks follow what `generate` gives the model: 2-D over past + current tokens for a growing cache; for a
static cache, 4-D `[batch, 1, query, max_cache_len]` rows (causal over cache slots, padding masked).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hfexport.core.errors import InputError
from hfexport.core.positions import apply as rebuild_positions
from hfexport.core.positions import text_positions
from hfexport.generation_spec import GenerationSpec
from hfexport.naming import OUTPUT_PREFIX
from hfexport.runtime.drivers import Driver, RuntimeOptions, Step
from hfexport.runtime.generation_session import SavedGeneration, open_session
from hfexport.runtime.sampling import Sampler, keep_eos_away, process_logits


def static_mask(valid: torch.Tensor, first_slot: int, query: int) -> torch.Tensor:
    """4-D mask rows for `query` tokens written at cache slots `first_slot...`: causal over slots, padding off."""
    slots = torch.arange(valid.shape[1])
    rows = torch.arange(first_slot, first_slot + query)
    causal = slots[None, :] <= rows[:, None]
    return (causal[None] & valid[:, None, :].bool())[:, None]


def _encoder_outputs(outputs: Any, samples: Mapping[str, Any], spec: GenerationSpec) -> Any:
    """The encoder output in the container the decoder steps were exported with (a `ModelOutput` or a tuple),
    with every field the samples had (Moonshine's encoder returns its downsampled `attention_mask` too).

    `outputs` is what the driver's `features` returns: a ModelOutput (Dynamo) or a dict by flat output name.
    Without samples (a loaded ONNX / OpenVINO artifact), a dict with the recorded field names gives the same
    flat input names (`encoder_outputs.last_hidden_state`)."""
    if isinstance(outputs, Mapping):
        named = {k.removeprefix(OUTPUT_PREFIX): v for k, v in outputs.items()}
        hidden = next(iter(outputs.values()))
    else:
        named, hidden = {}, outputs[0]
    sample = next((s["encoder_outputs"] for s in samples.values() if "encoder_outputs" in s), None)
    if sample is not None and not isinstance(sample, (tuple, list)):
        fields = {k: named[k] for k in sample if k != "last_hidden_state" and named.get(k) is not None}
        return type(sample)(last_hidden_state=hidden, **fields)
    if sample is None and spec.encoder_output_fields:
        first, *rest = spec.encoder_output_fields
        return {first: hidden, **{k: named[k] for k in rest if k in named}}
    return (hidden,)


def _first_tensor(value: Any) -> torch.Tensor:
    return value[0] if isinstance(value, (tuple, list)) else next(iter(value.values()))


def _like(value: Any, sample: Any) -> Any:
    """`value` (a ModelOutput or dict of features) with only the fields of `sample`, in `sample`'s order."""
    if not isinstance(sample, Mapping) or not isinstance(value, Mapping):
        return value
    fields = {k: value[k] for k in sample if k in value}
    return fields if type(sample) is dict else type(sample)(**fields)


def prompt_logits(
    components: Mapping[str, Any] | SavedGeneration,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    *,
    spec: GenerationSpec | None = None,
    max_cache_len: int | None = None,
) -> torch.Tensor:
    """The logits `[batch, prompt, vocab]` of a decoder-only text export's first graph on an empty cache: what
    the model's forward returns for `input_ids` without a cache.

    Positions default to `arange(prompt)` for every row, as the model's own forward numbers them when called
    without `position_ids` (`generate` numbers a left-padded row from its first real token instead). Encoder-
    decoder and multimodal exports raise `InputError`: their first graph needs the encoder's outputs.
    """
    driver, _, spec = open_session(components, spec)
    if spec.is_encoder_decoder or spec.positions is not None or any(n.endswith("_features") for n in spec.components):
        raise InputError("prompt_logits runs decoder-only text exports; this one needs its encoder's outputs first")
    input_ids = torch.as_tensor(input_ids)
    batch, prompt = input_ids.shape
    mask2d = torch.ones_like(input_ids) if attention_mask is None else torch.as_tensor(attention_mask).long()
    single = "prefill" not in driver.names or (spec.static_cache and spec.multi_token_decode)
    first = "decode" if single else "prefill"
    length = max_cache_len or spec.max_cache_len
    if spec.static_cache and length is not None and prompt > length:
        raise InputError(f"the prompt ({prompt} tokens) exceeds the static cache ({length} slots): pass max_cache_len")
    if position_ids is None:
        position_ids = torch.arange(prompt, dtype=torch.long)[None].expand(batch, -1).contiguous()
    mask = mask2d
    if spec.static_cache and spec.components[first].mask_rank == 4 and length is not None:
        valid = torch.zeros((batch, length), dtype=torch.long)
        valid[:, :prompt] = mask2d
        mask = static_mask(valid, 0, prompt)
    driver.start(first, batch, length)
    return driver.run(first, Step(input_ids, mask, torch.as_tensor(position_ids), {}))


def generate(
    components: Mapping[str, Any] | SavedGeneration,
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None = None,
    max_new_tokens: int = 20,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    eos_token_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    streamer: Any = None,
    *,
    min_new_tokens: int = 0,
    encoder_inputs: Mapping[str, Any] | None = None,
    spec: GenerationSpec | None = None,
    max_cache_len: int | None = None,
    generator: torch.Generator | None = None,
    on_step: Callable[[Driver], None] | None = None,
    runtime_options: RuntimeOptions | None = None,
    torch_threads: int | None = 1,
) -> torch.Tensor:
    """Generate with exported components; returns `[batch, prompt + new]` token ids like `model.generate`.

    `components` is an `export_for_generation` result (any backend) or that result saved and loaded
    (`hfexport.load`). Greedy (`do_sample=False`) tokens equal `model.generate(do_sample=False)` with the
    same cache kind. `max_cache_len` sizes a static cache (default: the exported one). `streamer` gets
    `put(tokens)` per step and `end()`, like transformers'. `min_new_tokens` keeps `eos_token_id` (default:
    the model's) from ending a sequence earlier. For an encoder-decoder export, `input_ids`/`attention_mask`
    (or `encoder_inputs`, e.g. Whisper's `input_features`) feed the encoder, and the returned ids are the
    decoder's, from its start token. `on_step(driver)` is called after every decode step (tests read the
    driver's buffers there). `runtime_options` (`hfexport.runtime.drivers.RuntimeOptions`) opens the runtimes
    with ONNX Runtime session options or OpenVINO compile properties (profiling: `tools/profile_generate.py`);
    the sessions are kept for later calls without options, and options of another object open them again.
    `torch_threads`: torch's intra-op threads while the loop drives a runtime with threads of its own (ONNX
    Runtime, OpenVINO, ExecuTorch), restored after; None leaves them as they are (`Driver.running`).
    """
    driver, samples, spec = open_session(components, spec, runtime_options)
    # The loop's own tensor work runs beside the runtime's threads (see Driver.running).
    with driver.running(torch_threads):
        extra: dict[str, Any] = {}
        if spec.is_encoder_decoder:
            input_ids, attention_mask, extra = _encode(driver, samples, spec, input_ids, attention_mask, encoder_inputs)
        elif input_ids is None:
            raise InputError("generate() needs input_ids")
        input_ids = torch.as_tensor(input_ids)
        length = max_cache_len or spec.max_cache_len
        if spec.static_cache and length is not None and input_ids.shape[1] + max_new_tokens > length:
            raise InputError(
                f"prompt ({input_ids.shape[1]}) + max_new_tokens ({max_new_tokens}) exceed the static cache "
                f"({length} slots); pass a larger max_cache_len (the exported graphs take any length when exported "
                "with dynamic=True)"
            )
        state, logits = _prefill(driver, samples, spec, input_ids, attention_mask, extra, encoder_inputs, length)
        eos = eos_token_id if eos_token_id is not None else spec.eos_token_id
        pad = pad_token_id if pad_token_id is not None else (spec.pad_token_id if spec.pad_token_id is not None else 0)
        choose = _TokenChoice(
            Sampler(do_sample, temperature, top_k, top_p, generator),
            torch.tensor([eos] if isinstance(eos, int) else list(eos or []), dtype=torch.long),
            pad,
            min_new_tokens,
            max_new_tokens,
        )
        return _decode(driver, spec, state, logits, choose, streamer, on_step)


def _encode(
    driver: Driver,
    samples: Mapping[str, Any],
    spec: GenerationSpec,
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    encoder_inputs: Mapping[str, Any] | None,
) -> tuple[torch.Tensor, None, dict[str, Any]]:
    """An encoder-decoder's encoder, run once: (the decoder start ids, no decoder mask, the inputs of every decoder
    step: the encoder's output and mask). Decoding starts from the decoder start token, as transformers'
    generate does."""
    extra: dict[str, Any] = {}
    encoder = {**dict(encoder_inputs or {})}
    if input_ids is not None:
        encoder["input_ids"] = torch.as_tensor(input_ids)
    if attention_mask is not None:  # the mask of input_ids, or of input_values / input_features
        encoder["attention_mask"] = torch.as_tensor(attention_mask)
    extra["encoder_outputs"] = _encoder_outputs(driver.features("encoder", encoder), samples, spec)
    hidden = _first_tensor(extra["encoder_outputs"])
    if "attention_mask" in encoder:
        extra["attention_mask"] = encoder["attention_mask"]
    if spec.decoder_start_token_id is None:
        raise InputError("the export records no decoder_start_token_id; set it on the model's config")
    return torch.full((hidden.shape[0], 1), spec.decoder_start_token_id, dtype=torch.long), None, extra


@dataclass
class _Prompt:
    """What the first forward leaves for the decode loop: the ids and 2-D mask so far, the static cache's valid
    slots (None for a growing cache), the last position and the multimodal rope delta, and the inputs decode steps
    take besides the new token (`extra` every step; `every_step` the image features of a model without a cache;
    `per_token` the prompt's last column of a per-token input; `constant` inputs passed unchanged)."""

    input_ids: torch.Tensor
    mask2d: torch.Tensor
    valid: torch.Tensor | None
    last_position: torch.Tensor
    rope_delta: torch.Tensor | None
    extra: dict[str, Any]
    every_step: dict[str, Any]
    per_token: dict[str, Any]
    constant: dict[str, Any]

    def mask_for(self, spec: GenerationSpec, name: str, query: int, written: int) -> torch.Tensor:
        """The mask input of component `name` for `query` tokens written at cache slot `written`."""
        if spec.components[name].mask_rank == 4 and self.valid is not None:
            return static_mask(self.valid, written, query)
        # The current tokens' columns as their own tensor: a column slice is a strided view, which the
        # ExecuTorch runtime refuses ("Input 1 ... should be contiguous"; Mamba's decode on XNNPACK).
        return self.mask2d[:, -query:].contiguous() if spec.mask_current_only else self.mask2d


def _prefill(
    driver: Driver,
    samples: Mapping[str, Any],
    spec: GenerationSpec,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    extra: dict[str, Any],
    encoder_inputs: Mapping[str, Any] | None,
    length: int | None,
) -> tuple[_Prompt, torch.Tensor]:
    """The prompt's forward (the `prefill` component, or `decode` where one graph takes the prompt too): the
    cache started, positions (multimodal ones rebuilt from the export's template), modality features handed to
    it. Returns the loop's state and the prompt's logits."""
    batch, prompt = input_ids.shape
    mask2d = torch.ones_like(input_ids) if attention_mask is None else torch.as_tensor(attention_mask).long()
    # A static cache with multi-token decode needs one graph: the prompt goes through `decode` too.
    single = "prefill" not in driver.names or (spec.static_cache and spec.multi_token_decode)
    first = "decode" if single else "prefill"
    driver.start(first, batch, length)
    positions = text_positions(mask2d)
    first_positions, rope_delta = positions, None
    if spec.positions is not None and not single:
        # Multimodal rotary positions (Qwen2-VL style), which generate computes with model code: rebuilt from
        # the export's template; decode steps add each row's delta to the plain position.
        template = spec.positions
        types = (encoder_inputs or {}).get(template.type_key) if template.type_key else None
        if template.type_key and types is None:
            raise InputError(f"this export builds multimodal positions from {template.type_key}: pass it too")
        first_positions, rope_delta = rebuild_positions(template, input_ids, mask2d, types)
    valid = torch.zeros((batch, length), dtype=torch.long) if spec.static_cache else None
    if valid is not None:
        valid[:, :prompt] = mask2d
    first_extra = extra
    if encoder_inputs and not spec.is_encoder_decoder:
        # Modality inputs the first forward takes itself (Fuyu's image_patches, token_type_ids...).
        taken = spec.components[first].inputs
        first_extra = {**extra, **{k: v for k, v in encoder_inputs.items() if k in taken}}
    modalities = [n for n in spec.components if n.endswith("_features")]
    if modalities and not spec.is_encoder_decoder:
        first_extra = {
            **first_extra,
            "mm_encoder_outputs": _modality_features(driver, samples, first, modalities, encoder_inputs),
        }
    state = _Prompt(input_ids, mask2d, valid, positions[:, -1:], rope_delta, extra, {}, {}, {})
    logits = driver.run(first, Step(input_ids, state.mask_for(spec, first, prompt, 0), first_positions, first_extra))
    # Per-token inputs besides the ids (PaliGemma's token_type_ids) that decode steps take too: generate
    # extends them by repeating their last column, so each new token gets the prompt's last value.
    decode_inputs = spec.components["decode"].inputs if "decode" in spec.components else []
    state.per_token = {
        k: torch.as_tensor(v)[:, -1:]
        for k, v in (encoder_inputs or {}).items()
        if k in decode_inputs and torch.is_tensor(v) and v.ndim == 2 and tuple(v.shape) == (batch, prompt)
    }
    # A model without a cache (use_cache=False) merges the image features again at every step.
    if "mm_encoder_outputs" in decode_inputs and "mm_encoder_outputs" in first_extra:
        state.every_step = {"mm_encoder_outputs": first_extra["mm_encoder_outputs"]}
    # Inputs generate keeps passing to every step unchanged (Qwen2-Audio's feature_attention_mask).
    state.constant = {
        k: v for k, v in (encoder_inputs or {}).items() if k in decode_inputs and k not in state.per_token
    }
    return state, logits


def _modality_features(
    driver: Driver,
    samples: Mapping[str, Any],
    first: str,
    modalities: list[str],
    encoder_inputs: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """As transformers' generate: the modality features first, handed to the first forward, which merges them at
    the image tokens; later steps read them from the cache."""
    from hfexport.frontends.generation import tensor_fields

    if not encoder_inputs:
        raise InputError(f"this export takes {modalities}: pass their inputs (pixel_values...) as encoder_inputs")
    features = {n.removesuffix("_features"): driver.features(n, encoder_inputs) for n in modalities}
    given = tensor_fields(features)
    sample = samples.get(first, {}).get("mm_encoder_outputs")
    if isinstance(sample, Mapping) and not driver.feeds_by_name:
        # The fields the first forward was exported with, in its order (the features graph may return more,
        # e.g. hidden_states, which generate does not hand over). Named drivers feed by flat input name.
        given = {m: _like(features[m], sample[m]) if m in sample else v for m, v in given.items()}
    return given


@dataclass
class _TokenChoice:
    """Sampling: the next token of each row from the last logits (EOS kept away before `min_new_tokens`, the
    logits processed as the export recorded, the sampler's pick), a finished row padded."""

    sampler: Sampler
    eos_ids: torch.Tensor
    pad: int
    min_new_tokens: int
    max_new_tokens: int

    def __call__(
        self, logits: torch.Tensor, index: int, prompt: int, spec: GenerationSpec, unfinished: torch.Tensor
    ) -> torch.Tensor:
        scores = logits[:, -1, :]
        if index < self.min_new_tokens and len(self.eos_ids):
            scores = keep_eos_away(scores, self.eos_ids)
        scores = process_logits(scores, spec, index, self.max_new_tokens, prompt)
        token = self.sampler(scores)
        return torch.where(unfinished, token, torch.full_like(token, self.pad))


def _decode(
    driver: Driver,
    spec: GenerationSpec,
    state: _Prompt,
    logits: torch.Tensor,
    choose: _TokenChoice,
    streamer: Any,
    on_step: Callable[[Driver], None] | None,
) -> torch.Tensor:
    """The decode loop: a token per step from `logits` until `max_new_tokens` or every row's EOS, each fed back
    through the `decode` component (or the whole sequence, for a model without a cache)."""
    input_ids, mask2d, valid = state.input_ids, state.mask2d, state.valid
    batch, prompt = input_ids.shape
    sequences = input_ids
    unfinished = torch.ones(batch, dtype=torch.bool)
    if streamer is not None:
        streamer.put(input_ids)
    written = prompt
    last_position = state.last_position
    for index in range(choose.max_new_tokens):
        token = choose(logits, index, prompt, spec, unfinished)
        sequences = torch.cat([sequences, token[:, None]], dim=-1)
        if streamer is not None:
            streamer.put(token[:, None])
        if len(choose.eos_ids):
            unfinished &= ~torch.isin(token, choose.eos_ids)
        if index == choose.max_new_tokens - 1 or not bool(unfinished.any()):
            break
        mask2d = state.mask2d = torch.cat([mask2d, torch.ones((batch, 1), dtype=mask2d.dtype)], dim=-1)
        if valid is not None:
            valid[:, written] = 1
        last_position = last_position + 1
        if spec.cache_key is None or spec.decode_full_sequence:
            # No cache (a model that returns none, e.g. a BERT decoder without is_decoder), or a decode step
            # that takes every token and slices off the cached ones itself: as transformers' generate does,
            # every step runs the whole sequence so far.
            full = (mask2d.cumsum(-1) - 1).masked_fill(mask2d == 0, 1)
            step = Step(sequences, mask2d, full, {**state.extra, **state.every_step})
        else:
            step_positions = last_position
            if state.rope_delta is not None:
                step_positions = last_position + state.rope_delta
                if spec.positions.decode_rows is not None:
                    step_positions = step_positions[None].expand(spec.positions.decode_rows, -1, -1).contiguous()
            inputs = {**state.constant, **state.extra, **state.per_token}
            step = Step(token[:, None], state.mask_for(spec, "decode", 1, written), step_positions, inputs)
        logits = driver.run("decode", step)
        written += 1
        if on_step is not None:
            on_step(driver)
    if streamer is not None:
        streamer.end()
    return sequences
