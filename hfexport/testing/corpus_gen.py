"""Generate corpus entries (the JSON format of ``hfexport.testing.corpus``) for any transformers model type.

The hand-made corpus (``tests/fixtures/corpus``) covers a chosen set of architectures; this module derives a tiny
entry for every ``model_type`` of an auto mapping, so coverage is measured against transformers itself rather
than against a selection. For one model type it:

1. shrinks the config class's defaults (widths, 2 layers, small vocab, consistent head sizes, nested
   sub-configs too) — a few shrink levels, from aggressive to "layers only", since no single recipe fits all;
   only when every level failed: the levels again with the size fields the class leaves None filled
   (``+fill-none``), then the most-shrunk level 4x wider (``+wide``), so entries that build plainly never change;
2. builds sample inputs from the model's forward signature and the config (text, image, audio, placeholders);
3. checks the entry the way its users will read it: through :class:`CorpusEntry` (build from the stored dict,
   forward, the grown input and, for generative families, ``generate`` a few tokens).

Failures are returned as a reason string, never raised, so a caller can list every type that could not be built.
``tools/gen_corpus.py`` drives it over whole mappings with a per-model timeout.
"""

from __future__ import annotations

import copy
import functools
import inspect
import json
import re
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .corpus import CorpusEntry, entry_from_dict

__all__ = ["FAMILIES", "Family", "GenResult", "family_types", "generate_entry", "shrink_config_kwargs"]


@dataclass(frozen=True)
class Family:
    """One family of the generated corpus: which auto mappings list its types and how to feed its models."""

    name: str
    mappings: tuple[str, ...]  # attribute names in transformers.models.auto.modeling_auto, first wins
    auto_classes: tuple[str, ...]  # the auto class of each mapping
    kind: str  # text | seq2seq | vlm | speech_seq2seq | audio | image | dual | auto (decided by the signature)
    generative: bool = False
    output: str = "logits"


FAMILIES: tuple[Family, ...] = (
    Family("causal_lm", ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",), ("AutoModelForCausalLM",), "text", True),
    Family("seq2seq", ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",), ("AutoModelForSeq2SeqLM",), "seq2seq", True),
    Family(
        "encoder",
        ("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "MODEL_FOR_MASKED_LM_MAPPING_NAMES"),
        ("AutoModelForSequenceClassification", "AutoModelForMaskedLM"),
        "text",
    ),
    Family("vlm", ("MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",), ("AutoModelForImageTextToText",), "vlm", True),
    Family(
        "speech_seq2seq",
        ("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",),
        ("AutoModelForSpeechSeq2Seq",),
        "speech_seq2seq",
        True,
    ),
    Family("ctc", ("MODEL_FOR_CTC_MAPPING_NAMES",), ("AutoModelForCTC",), "audio"),
    Family(
        "audio_classification",
        ("MODEL_FOR_AUDIO_CLASSIFICATION_MAPPING_NAMES",),
        ("AutoModelForAudioClassification",),
        "audio",
    ),
    Family(
        "image_classification",
        ("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",),
        ("AutoModelForImageClassification",),
        "image",
    ),
    Family(
        "object_detection", ("MODEL_FOR_OBJECT_DETECTION_MAPPING_NAMES",), ("AutoModelForObjectDetection",), "image"
    ),
    Family(
        "semantic_segmentation",
        ("MODEL_FOR_SEMANTIC_SEGMENTATION_MAPPING_NAMES",),
        ("AutoModelForSemanticSegmentation",),
        "image",
    ),
    Family(
        "zero_shot_image",
        ("MODEL_FOR_ZERO_SHOT_IMAGE_CLASSIFICATION_MAPPING_NAMES",),
        ("AutoModelForZeroShotImageClassification",),
        "dual",
        output="logits_per_image",
    ),
    # Base models whose type no family above lists: everything else a `model_type` can build.
    Family("feature_extraction", ("MODEL_MAPPING_NAMES",), ("AutoModel",), "auto", output="last_hidden_state"),
)


@functools.cache
def family_types(family: Family) -> dict[str, str]:
    """``{model_type: auto_class}`` of a family, in mapping order; feature extraction excludes the other families.

    Cached (the mappings do not change in a process): treat the dict as read-only.
    """
    from transformers.models.auto import modeling_auto

    types: dict[str, str] = {}
    for mapping, auto_class in zip(family.mappings, family.auto_classes, strict=True):
        for model_type in getattr(modeling_auto, mapping):
            types.setdefault(model_type, auto_class)
    if family.name == "feature_extraction":
        taken = {t for other in FAMILIES if other.name != family.name for t in family_types(other)}
        types = {t: c for t, c in types.items() if t not in taken}
    return types


# --- config shrinking --------------------------------------------------------------------------------------------

TEXT_VOCAB = 128
SPECIAL_BASE = 100  # ids >= this are reserved for special tokens remapped into the small vocab
WIDTH, FFN, HEADS, HEAD_DIM, LAYERS = 32, 64, 2, 16, 2
IMAGE_SIZE, PATCH = 32, 4
WINDOW = 16  # sliding windows and chunks this small are crossed by the long shape checks (73, 138 tokens)

_WIDTH_KEYS = {"hidden_size", "d_model", "n_embd", "embed_dim", "word_embed_proj_dim", "model_dim", "dim"}
_WIDTH_KEYS |= {"projection_dim", "text_embed_dim", "vision_embed_dim", "embedding_size", "text_hidden_size"}
_WIDTH_KEYS |= {"projector_hidden_size", "encoder_hidden_size", "decoder_hidden_size", "vision_hidden_size"}
_WIDTH_KEYS |= {"out_hidden_size", "adapter_in_dim", "adapter_input_size", "text_hidden_dim"}
_WIDTH_KEYS |= {"adapter_out_dim", "adapter_output_size"}  # an adapter's output is the text width
_WIDTH_KEYS |= {"d_latents", "audio_hidden_size"}  # Perceiver's latents; an audio tower's width seen from a head
_FFN_KEYS = {"intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff", "hidden_dim", "ff_size"}
_FFN_KEYS |= {"n_inner", "mlp_dim", "decoder_intermediate_size", "encoder_intermediate_size", "ffn_hidden_size"}
_SMALL_FFN_KEYS = {"moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size"}
_SMALL_FFN_KEYS |= {"expert_ffn_hidden_size", "moe_ffn_hidden_size", "moe_hidden_size"}
_HEAD_KEYS = {"num_attention_heads", "n_head", "n_heads", "encoder_attention_heads", "decoder_attention_heads"}
_HEAD_KEYS |= {"num_heads", "attention_heads", "num_attention_heads_text"}
_HEAD_KEYS |= {"num_self_attention_heads", "num_cross_attention_heads"}
_KV_KEYS = {"num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num", "num_query_groups"}
_HEAD_DIM_KEYS = {"head_dim", "d_kv", "d_head", "attention_head_dim", "kv_channels", "v_head_dim"}
_LAYER_KEYS = {"num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers"}
_LAYER_KEYS |= {"num_decoder_layers", "num_encoder_layers", "depth", "encoder_num_hidden_layers"}
_LAYER_KEYS |= {"decoder_num_hidden_layers", "num_text_layers", "num_vision_layers"}
_LAYER_KEYS |= {"num_self_attends_per_block"}
_POSITION_KEYS = {"max_position_embeddings", "n_positions", "max_source_positions", "max_target_positions"}
_POSITION_KEYS |= {"n_ctx", "max_seq_len", "max_sequence_length", "seq_length"}
_EXPERT_KEYS = {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts"}
_TOPK_KEYS = {"num_experts_per_tok", "moe_topk", "num_experts_per_token", "top_k", "moe_k"}
_WINDOW_KEYS = {"sliding_window", "attention_chunk_size", "attention_window", "local_attention"}
_STATE_KEYS = {"state_size", "ssm_state_size", "d_state", "mamba_d_state"}
_LORA_KEYS = {"kv_lora_rank": 16, "q_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8}
_VOCAB_KEYS = {"vocab_size"}
# Every key the shrinking treats as a size (widths, depths, heads, positions, vocabularies).
SIZE_KEYS = frozenset(
    _WIDTH_KEYS | _FFN_KEYS | _SMALL_FFN_KEYS | _HEAD_KEYS | _KV_KEYS | _HEAD_DIM_KEYS | _LAYER_KEYS
) | frozenset(_POSITION_KEYS | _VOCAB_KEYS | _STATE_KEYS)


def _is_config(value: Any) -> bool:
    from transformers import PretrainedConfig

    return isinstance(value, PretrainedConfig)


def _token_id_key(key: str) -> bool:
    return key.endswith(("_token_id", "_token_index", "_token_ids")) or key in {"image_token", "video_token"}


def _collect_ids(config: Any, found: set[int]) -> None:
    """Every special token id of a config tree (ints or lists of ints under ``*_token_id``-like keys)."""
    for key, value in vars(config).items():
        if _is_config(value):
            _collect_ids(value, found)
        elif _token_id_key(key):
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                    found.add(v)


def _pick_layers(value: Any, n_orig: int) -> Any:
    """A per-layer list/str of the original depth cut to LAYERS entries, keeping a second kind if there is one."""
    items = list(value)
    first = items[0]
    other = next((x for x in items[1:] if x != first), items[-1] if n_orig > 1 else first)
    picked = [first, other][:LAYERS]
    return "".join(picked) if isinstance(value, str) else picked


def _uniform_cycle_head(key: str, value: Any) -> bool:
    """A layer-kind pattern repeated over the depth (RecurrentGemma's block_types: recurrent, recurrent,
    attention) whose first LAYERS kinds are all the same: cut to LAYERS layers, the model would have one kind
    only (all recurrent: its cache then has no attention layer and forward fails in ``get_seq_length``)."""
    if not any(word in key for word in ("type", "pattern", "block")):
        return False
    items = list(value)
    return (
        len(items) > LAYERS
        and all(isinstance(x, str) for x in items)
        and len(set(items[:LAYERS])) == 1
        and len(set(items)) > 1
    )


def _scaled_mrope(section: list[int], half: int) -> list[int]:
    """Rescale an mrope section (it must sum to head_dim // 2) to the new head size, keeping proportions."""
    total = sum(section)
    out = [max(1, s * half // total) for s in section]
    out[0] += half - sum(out)
    return out


def _shrink_level(
    config: Any,
    level: int,
    id_map: dict[int, int],
    heads_orig: int | None = None,
    fill_none: bool = False,
    wide: bool = False,
) -> dict[str, Any]:
    """Constructor kwargs that shrink one config (recursing into sub-configs).

    Levels: 0 shrinks everything (widths, heads, vocab, windows, images); 1 keeps windows/chunks and images as
    they are; 2 only cuts depth (layers, experts), for configs whose widths are tied by formulas we do not know;
    3 keeps the defaults (a small default model, e.g. a detector, whose stages are tied to each other).
    ``fill_none`` also gives a value to the size fields a config class leaves None (see `_fill_none`);
    ``wide`` makes the shrunk widths 4x wider (see `_widen`).
    """
    attrs = dict(vars(config))
    kwargs: dict[str, Any] = {}
    n_layers_orig = next(
        (attrs[k] for k in ("num_hidden_layers", "num_layers", "n_layer", "n_layers") if isinstance(attrs.get(k), int)),
        None,
    )
    heads = next((attrs[k] for k in _HEAD_KEYS if isinstance(attrs.get(k), int) and attrs[k] > 0), heads_orig)

    for key, value in attrs.items():
        if key.startswith("_") or key in {"architectures", "transformers_version", "model_type", "auto_map"}:
            continue
        if _is_config(value) and value.model_type == "timm_backbone":
            # timm is not a dependency: the same stages from transformers' ResNet (DETR-style detectors).
            kwargs[key] = _resnet_backbone(value, level)
            continue
        if _is_config(value):
            # A nested dict is rebuilt by model_type (backbones, encoder/decoder pairs), so it must name it.
            sub = _shrink_level(value, level, id_map, fill_none=fill_none, wide=wide)
            shrunk = {"model_type": value.model_type, **sub}
            if "backbone" in key:
                # A parent's default backbone differs from the backbone class's defaults (the stages it
                # outputs): start from the parent's, not from the class's.
                base = {k: v for k, v in value.to_dict().items() if k not in {"transformers_version", "architectures"}}
                shrunk = {**base, **shrunk}
            kwargs[key] = shrunk
            continue
        if isinstance(value, bool):
            # Never download a pretrained backbone, and build backbones from transformers rather than timm.
            if key in {"use_pretrained_backbone", "use_timm_backbone"} and value:
                kwargs[key] = False
            continue
        if _token_id_key(key) and level < 2:
            if isinstance(value, int) and value in id_map:
                kwargs[key] = id_map[value]
            elif isinstance(value, list) and all(isinstance(v, int) for v in value):
                kwargs[key] = [id_map.get(v, v) for v in value]
            continue
        if isinstance(value, int):
            new = _shrink_int(key, value, level, heads)
            if new is not None and new != value:
                kwargs[key] = new
            continue
        if level >= 3:
            continue
        per_layer = isinstance(value, list) or (isinstance(value, str) and ("pattern" in key or "override" in key))
        if n_layers_orig and n_layers_orig > LAYERS and per_layer and len(value) == n_layers_orig:
            if value:
                kwargs[key] = _pick_layers(value, n_layers_orig)
                if key in _FFN_KEYS and level < 2 and all(isinstance(v, int) and v > FFN for v in value):
                    kwargs[key] = [FFN] * LAYERS  # per-layer FFN widths (Gemma 3n's intermediate_size list)
            continue
        if per_layer and n_layers_orig and n_layers_orig > LAYERS and _uniform_cycle_head(key, value):
            kwargs[key] = _pick_layers(value, n_layers_orig)
            continue
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, int) for v in value):
            # Tuples too: VibeVoice's acoustic tokenizer declares its stage depths as a tuple.
            new_list = _shrink_list(key, list(value), level)
            if new_list is not None:
                kwargs[key] = new_list
            continue
        if isinstance(value, dict) and level < 2 and isinstance(value.get("mrope_section"), list):
            head_dim = HEAD_DIM
            rope = copy.deepcopy(value)
            rope["mrope_section"] = _scaled_mrope(value["mrope_section"], head_dim // 2)
            kwargs[key] = rope
    rope = attrs.get("rope_parameters")
    needs_mrope = "mrope_section" in getattr(type(config), "ignore_keys_at_rope_validation", ())
    if level < 2 and needs_mrope and isinstance(rope, dict) and "mrope_section" not in rope:
        # The modeling code defaults to [16, 24, 24] (head_dim 128): state a section that fits the new heads.
        kwargs["rope_parameters"] = {**rope, "mrope_section": _scaled_mrope([16, 24, 24], HEAD_DIM // 2)}
    if level < 2 and "layer_types" in kwargs and "num_hidden_layers" not in attrs:
        kwargs.pop("layer_types")
    if level < 2:
        _fix_ssm_heads(attrs, kwargs)
        _tie_mla_head_dim(attrs, kwargs)
    if level < 3:
        _fit_depth_parts(attrs, kwargs)
    if fill_none and level < 3:
        _fill_none(attrs, kwargs)
    if fill_none and level < 2:
        _fill_layer_rope(config, attrs, kwargs)
    if wide:
        _widen(attrs, kwargs)
    return kwargs


_WIDE = 4


def _widen(attrs: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """Widths, FFN sizes and head sizes 4x the shrunk ones (never past the defaults): for models that round a
    size up to a multiple of 64 on one side only (xLSTM's config rounds hidden * 0.5 up to 64 for its cache
    state while the layer uses hidden * 0.5 itself: at 32 wide the state is 32 x 32 and the layer's 8 x 16).
    Head counts stay, so heads x head size still equals the width."""
    sized = _WIDTH_KEYS | _FFN_KEYS | _SMALL_FFN_KEYS | _HEAD_DIM_KEYS
    for key, value in list(kwargs.items()):
        old = attrs.get(key)
        if key in sized and isinstance(value, int) and isinstance(old, int) and value < old:
            kwargs[key] = min(old, value * _WIDE)


_DEPTH_PART = re.compile(r"^(n|num)_\w+_layers$")


def _fit_depth_parts(attrs: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """Configs that split `num_hidden_layers` into named parts (Dory: n_input_layers + n_recurrent_layers +
    n_output_layers = num_hidden_layers) keep one layer per part. Cutting the depth alone leaves the parts at
    their defaults (8 + 8 of 2 layers: the derived recurrent part became -14, and the model ran every layer twice
    with one cache, a model no checkpoint describes)."""
    depth = attrs.get("num_hidden_layers")
    parts = [
        k
        for k, v in attrs.items()
        if _DEPTH_PART.match(k) and k not in _LAYER_KEYS and isinstance(v, int) and not isinstance(v, bool) and v > 0
    ]
    if not isinstance(depth, int) or len(parts) < 2 or sum(attrs[k] for k in parts) != depth or depth <= len(parts):
        return
    kwargs.update(dict.fromkeys(parts, 1), num_hidden_layers=len(parts))
    kinds = attrs.get("layer_types")
    if isinstance(kinds, list) and len(kinds) == depth and kinds:
        picked = _pick_layers(kinds, depth)
        kwargs["layer_types"] = [picked[i % len(picked)] for i in range(len(parts))]


def _tie_mla_head_dim(attrs: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """MLA configs whose ``head_dim`` is their rope head size (DeepSeek-V3, AXK1, LongCat-Flash: the rotary
    tables are built for ``head_dim``, the rotated query slice is ``qk_rope_head_dim`` wide) keep the two equal:
    shrinking them to different sizes (16 and 8) fails at the rope product ("size of tensor a (4) must match
    the size of tensor b (8)")."""
    rope = attrs.get("qk_rope_head_dim")
    if isinstance(rope, int) and rope > 0 and attrs.get("head_dim") == rope and "qk_rope_head_dim" in kwargs:
        kwargs["head_dim"] = kwargs["qk_rope_head_dim"]


def _fill_layer_rope(config: Any, attrs: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """An empty ``rope_parameters`` of a config with layer types: one default rope per layer type.

    Cohere Compass' text decoder reads ``rope_parameters[layer_type]`` (per-layer-type rope, the checkpoint's
    layout) while its class defaults to ``{}``: KeyError 'full_attention' at any size, and the flat
    ``{"mrope_section": ...}`` the mrope rule adds is rejected by the field's type. Per-type dicts hold both.
    """
    layer_types = kwargs.get("layer_types", attrs.get("layer_types"))
    if attrs.get("rope_parameters") != {} or not isinstance(layer_types, list) or not layer_types:
        return
    theta = getattr(type(config), "default_theta", None)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": theta if isinstance(theta, float) else 10000.0}
    if "mrope_section" in getattr(type(config), "ignore_keys_at_rope_validation", ()):
        rope["mrope_section"] = _scaled_mrope([16, 24, 24], HEAD_DIM // 2)
    kwargs["rope_parameters"] = {kind: dict(rope) for kind in dict.fromkeys(layer_types)}


def _fill_none(attrs: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """Give the size fields a config class leaves None a value its model can build with.

    Some classes' defaults do not build a model at any size: a field the model reads as a number or a list
    defaults to None and only a checkpoint's config sets it (Ministral's and HunYuan's ``head_dim`` -> ``None **
    -0.5``, Dots1's expert count -> ``torch.empty(None, ...)``, LFM2-MoE's ``layer_types`` -> ``None[i]``). The
    generator tries this only after the plain kwargs failed, so entries that build without it are unchanged.
    ``head_dim`` is derived (width / heads), expert counts and top-k take the shrunk values, a per-layer type
    list takes full attention on every layer (the one layer type every decoder knows).
    """
    hidden = kwargs.get("hidden_size", attrs.get("hidden_size"))
    heads = kwargs.get("num_attention_heads", attrs.get("num_attention_heads"))
    layers = kwargs.get("num_hidden_layers", attrs.get("num_hidden_layers"))
    for key, value in attrs.items():
        if value is not None or key in kwargs:
            continue
        if key == "head_dim" and isinstance(hidden, int) and isinstance(heads, int) and heads > 0:
            kwargs[key] = hidden // heads
        elif key in _KV_KEYS and isinstance(heads, int):
            kwargs[key] = heads  # multi-head attention (Nemotron: num_heads // None)
        elif key in _EXPERT_KEYS:
            kwargs[key] = 4
        elif key in _TOPK_KEYS:
            kwargs[key] = 2
        elif key in {"n_shared_experts", "num_shared_experts"}:
            kwargs[key] = 1
        elif key in _SMALL_FFN_KEYS:
            kwargs[key] = WIDTH
        elif key == "layer_types" and isinstance(layers, int) and layers > 0:
            kwargs[key] = ["full_attention"] * layers
        # A sub-module's own attention sizes (Qwen4-Exp's QSA indexer: indexer_n_heads, indexer_kv_heads,
        # indexer_head_dim, all None while the default layer types use it) and its token budget per block.
        elif key.endswith("_kv_heads"):
            kwargs[key] = 1
        elif key.endswith(("_n_heads", "_num_heads")):
            kwargs[key] = HEADS
        elif key.endswith("_head_dim"):
            kwargs[key] = HEAD_DIM
        elif key.endswith("_compress_ratio"):
            kwargs[key] = 4
        elif key.endswith("_budget"):
            kwargs[key] = WINDOW  # a multiple of the compress ratio


def _fix_ssm_heads(attrs: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """Mamba2-style mixers need heads x head_dim == expand x hidden: derive the head count from the new sizes."""
    hidden = kwargs.get("hidden_size", attrs.get("hidden_size"))
    for heads_key, dim_key, expand_key in (
        ("num_heads", "head_dim", "expand"),
        ("mamba_n_heads", "mamba_d_head", "mamba_expand"),
        ("mamba_num_heads", "mamba_head_dim", "mamba_expand"),
    ):
        if heads_key in attrs and dim_key in attrs and isinstance(attrs.get(expand_key), (int, float)):
            head_dim = kwargs.get(dim_key, attrs[dim_key])
            if isinstance(head_dim, int) and head_dim > HEAD_DIM:
                head_dim = kwargs[dim_key] = HEAD_DIM
            if isinstance(hidden, int) and isinstance(head_dim, int) and head_dim > 0:
                kwargs[heads_key] = max(1, int(attrs[expand_key] * hidden) // head_dim)
        if "mamba_d_ssm" in attrs and isinstance(hidden, int) and isinstance(attrs.get(expand_key), (int, float)):
            kwargs["mamba_d_ssm"] = int(attrs[expand_key] * hidden)


def _resnet_backbone(timm: Any, level: int) -> dict[str, Any]:
    """A transformers ResNet backbone config standing in for a timm one, with the same stages out."""
    out_indices = list(getattr(timm, "out_indices", None) or [1, 2, 3, 4])
    config: dict[str, Any] = {"model_type": "resnet", "out_indices": out_indices, "depths": [1, 1, 1, 1]}
    if level < 2:
        config.update(embedding_size=16, hidden_sizes=[16, 32, 64, 128], layer_type="basic")
    return config


def _shrink_int(key: str, value: int, level: int, heads: int | None) -> int | None:
    """The shrunk value of one integer hyper-parameter, or None to keep it."""
    if level >= 3:
        return None
    if key in _LAYER_KEYS and value > LAYERS:
        return LAYERS
    if "shared_layers" in key and value > 0:
        # The last N layers reuse the K/V of earlier layers of the same type (Gemma 3n: 15 of 35); 2 layers of
        # two types leave no earlier producer for either, so sharing goes.
        return 0
    if key in _EXPERT_KEYS and value > 4:
        return 4
    if key in _TOPK_KEYS and value > 2:
        return 2
    if key in {"n_shared_experts", "num_shared_experts"} and value > 1:
        return 1
    if key in {"n_group", "topk_group", "num_expert_group", "n_groups", "mamba_n_groups"} and value > 1:
        return 1
    if key in {"first_k_dense_replace", "first_dense_layers"} and value > 1:
        return 1
    # Hybrids place attention/experts by period and offset: keep one of each kind within the 2 layers.
    if key in {"attn_layer_offset", "expert_layer_offset"} and value > 1:
        return 1
    if key in {"attn_layer_period", "expert_layer_period"} and value > 2:
        return 2
    if level >= 2:
        return None
    if key in _WIDTH_KEYS and value > WIDTH:
        return WIDTH
    if key in _FFN_KEYS and value > FFN:
        return FFN
    if key in _SMALL_FFN_KEYS and value > WIDTH:
        return WIDTH
    if key in _HEAD_KEYS and value > HEADS:
        return HEADS
    if key in _KV_KEYS and value > 1:
        return 1 if heads is not None and value < heads else HEADS
    if key in _HEAD_DIM_KEYS and value > HEAD_DIM:
        return HEAD_DIM
    if key == "rotary_dim" and value > HEAD_DIM // 2:
        return HEAD_DIM // 2
    if key in {"vocab_size_per_layer_input"} and value > TEXT_VOCAB:
        return TEXT_VOCAB
    if key in {"hidden_size_per_layer_input", "emb_dim"} and value > WIDTH // 2:
        return WIDTH // 2 if key != "emb_dim" else WIDTH
    if key.startswith("hidden_size_") and value > WIDTH:
        return WIDTH  # another tower's width seen from this one (BLT's local decoder: hidden_size_global)
    if key.endswith(("_vocab", "_vocab_size")) and value > TEXT_VOCAB:
        # Hashed n-gram tables (BLT's encoder_hash_byte_group_vocab: 500002 rows) and a head's own vocabulary
        # (Inkling2's unpadded_vocab_size: its lm_head would emit ids past the shrunk embedding table).
        return TEXT_VOCAB
    if key in _LORA_KEYS and value > _LORA_KEYS[key]:
        return _LORA_KEYS[key]
    if key in _VOCAB_KEYS and value > TEXT_VOCAB:
        return TEXT_VOCAB
    if key in _STATE_KEYS and value > 16:
        return 16
    if key == "num_filters" and value > 4:
        return 4  # base channels of a conv tower doubling per stage (VibeVoice: 32 -> 2048 over 6 stages)
    if key == "num_latents" and value > 16:
        return 16  # Perceiver's latent array (256 x 1280 by default)
    if key in _POSITION_KEYS and value > 512:
        return 512
    if level == 0:
        if key in _WINDOW_KEYS and value > WINDOW:
            return WINDOW
        if key == "image_size" and value > IMAGE_SIZE:
            return IMAGE_SIZE
        if key == "patch_size" and value > PATCH:
            return PATCH
        if key in {"mm_tokens_per_image", "image_seq_length"} and value > 4:
            return 4  # pooled to a square of side 2: fits the 8x8 patches of a 32-pixel image
    return None


def _shrink_list(key: str, value: list[int], level: int) -> list[int] | None:
    """Per-stage lists of vision backbones: one block per stage, narrower stages, fewer heads."""
    if level >= 3:
        return None
    if key in {"depths", "num_blocks", "layers", "blocks_per_stage"}:
        return [1] * len(value)
    if level >= 2:
        return None
    if key in {"hidden_sizes", "embed_dims", "embed_dim", "neck_hidden_sizes"} and min(value) > 16:
        factor = min(value) // 16
        if all(v % factor == 0 for v in value):
            return [v // factor for v in value]
    if key in {"num_heads", "num_attention_heads"} and len(value) > 1:
        return [max(1, v // max(1, value[0])) for v in value]
    if key in {"conv_dim"} and min(value) > 32:
        return [32] * len(value)
    if level == 0 and key == "image_size" and len(value) == 2 and min(value) > IMAGE_SIZE:
        return [IMAGE_SIZE, IMAGE_SIZE]
    return None


def shrink_config_kwargs(
    config_class: type, level: int = 0, fill_none: bool = False, wide: bool = False
) -> dict[str, Any]:
    """Keyword arguments for ``config_class(**kwargs)`` that give a tiny, consistent config at ``level``."""
    default = config_class()
    ids: set[int] = set()
    _collect_ids(default, ids)
    big = sorted(i for i in ids if i >= SPECIAL_BASE)
    free = list(range(TEXT_VOCAB - 1, SPECIAL_BASE - 1, -1))
    id_map = {old: free[n] for n, old in enumerate(big) if n < len(free)}
    return _shrink_level(default, level, id_map, fill_none=fill_none, wide=wide)


# --- inputs -------------------------------------------------------------------------------------------------------


def _sub(config: Any, *names: str) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return None


def _text_config(config: Any) -> Any:
    return _sub(config, "text_config", "decoder") if _is_config(_sub(config, "text_config", "decoder")) else config


def _vision_config(config: Any) -> Any:
    vision = _sub(config, "vision_config", "vision_tower_config", "backbone_config")
    return vision if _is_config(vision) else config


def _int(value: Any, default: int) -> int:
    if isinstance(value, (list, tuple)) and value:
        value = value[0]
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else default


def _text_spec(length: int) -> dict[str, Any]:
    return {"dtype": "int64", "shape": [2, length], "init": "text"}


def _ones(length: int) -> dict[str, Any]:
    return {"dtype": "int64", "shape": [2, length], "init": "full", "value": 1}


@dataclass
class Candidate:
    """One way to feed a model: inputs, grow specs and inputs that ``generate`` must not get."""

    inputs: dict[str, Any]
    grow: dict[str, Any]
    generate_exclude: list[str]
    note: str = ""


def _text_candidate(params: set[str], config: Any, length: int = 8) -> Candidate:
    inputs: dict[str, Any] = {"input_ids": _text_spec(length)}
    grow: dict[str, Any] = {"input_ids": {"axis": 1, "by": 5, "fill": "text"}}
    if "attention_mask" in params:
        inputs["attention_mask"] = _ones(length)
        grow["attention_mask"] = {"axis": 1, "by": 5, "fill": 1}
    if "token_type_ids" in params and _int(getattr(config, "type_vocab_size", 0), 0) > 0:
        inputs["token_type_ids"] = {"dtype": "int64", "shape": [2, length], "init": "full", "value": 0}
        grow["token_type_ids"] = {"axis": 1, "by": 5, "fill": 0}
    return Candidate(inputs, grow, [])


def _image_spec(config: Any) -> dict[str, Any]:
    vision = _vision_config(config)
    size = _int(_sub(vision, "image_size", "img_size", "input_size"), IMAGE_SIZE)
    channels = _int(_sub(vision, "num_channels", "in_channels", "in_chans"), 3)
    return {"dtype": "float32", "shape": [2, channels, size, size], "init": "rand"}


def _decoder(inputs: dict[str, Any], grow: dict[str, Any], length: int = 4) -> list[str]:
    inputs["decoder_input_ids"] = _text_spec(length)
    grow["decoder_input_ids"] = {"axis": 1, "by": 5, "fill": "text"}
    return ["decoder_input_ids"]


def candidates(kind: str, params: set[str], config: Any) -> list[Candidate]:
    """Ways to feed a model of this kind, most natural first; the generator keeps the first that runs."""
    if kind == "auto":
        if {"hidden_states", "grid_thw"} <= params:
            return [_vision_tower_candidate(config)]
        if "input_ids" in params and "pixel_values" in params:
            kind = "dual"
        elif "input_ids" in params:
            kind = "seq2seq" if "decoder_input_ids" in params else "text"
        elif "pixel_values" in params:
            kind = "image"
        elif "input_features" in params and "decoder_input_ids" in params:
            kind = "speech_seq2seq"
        elif "input_values" in params or "input_features" in params:
            kind = "audio"
        else:
            return []
    if kind == "text":
        cand = _text_candidate(params, config)
        eos = getattr(config, "eos_token_id", None)
        if getattr(config, "is_encoder_decoder", False) and isinstance(eos, int):
            # BART-style classification heads pool the <eos> token: each row ends with one.
            cand.inputs["input_ids"] = {"dtype": "int64", "shape": [2, 8], "placeholder": _tail(eos)}
        return [cand]
    if kind == "seq2seq":
        cand = _text_candidate(params, config)
        if "decoder_input_ids" in params:  # decoder-only LMs in this mapping (VibeVoice ASR) would ignore them
            cand.generate_exclude = _decoder(cand.inputs, cand.grow)
        if "input_features" not in params:
            return [cand]
        # Speech models listed as seq2seq LMs (Voxtral Realtime) refuse text alone: text with audio features next.
        both = []
        for audio in _audio_candidates("audio", params, config):
            audio.inputs = {**cand.inputs, **audio.inputs}
            audio.grow = {**cand.grow, **audio.grow}
            audio.generate_exclude = list(cand.generate_exclude)
            both.append(audio)
        return [cand, *both]
    if kind == "image":
        spec = _image_spec(config)
        larger = {**spec, "shape": [*spec["shape"][:2], 128, 128]}
        # Detectors and segmenters stride by 32 and more: a 32-pixel image leaves them no feature map.
        return [Candidate({"pixel_values": spec}, {}, []), Candidate({"pixel_values": larger}, {}, [], "128 pixels")]
    if kind == "dual":
        cand = _text_candidate(params, config)
        cand.inputs["pixel_values"] = _image_spec(config)
        return [cand]
    if kind == "vlm":
        return _vlm_candidates(params, config)
    if kind in {"audio", "speech_seq2seq"}:
        return _audio_candidates(kind, params, config)
    return []


def _tail(token: int) -> dict[str, Any]:
    return {"token": token, "count": 0, "tail": [token]}


def _vlm_candidates(params: set[str], config: Any, n_image_tokens: int | None = None) -> list[Candidate]:
    image_token = _sub(config, "image_token_id", "image_token_index")
    text = _text_config(config)
    vocab = _int(getattr(text, "vocab_size", None) or getattr(config, "vocab_size", None), TEXT_VOCAB)
    if not isinstance(image_token, int) or image_token >= vocab:
        cand = _text_candidate(params, config)
        cand.inputs["pixel_values"] = _image_spec(config)
        return [cand]
    if "image_grid_thw" in params:
        return _grid_candidates(params, config, image_token)
    out = []
    for n in [n_image_tokens] if n_image_tokens else [1, 16, 64]:
        length = n + 8
        ids = {"dtype": "int64", "placeholder": {"token": image_token, "count": n}, "shape": [2, length]}
        cand = _text_candidate(params, config, length)
        cand.inputs["input_ids"] = ids
        cand.inputs["pixel_values"] = _image_spec(config)
        cand.note = f"{n} image tokens"
        out.append(cand)
    for cand in list(out):  # (batch, images, channels, height, width): Idefics-style processors
        five = copy.deepcopy(cand)
        shape = five.inputs["pixel_values"]["shape"]
        five.inputs["pixel_values"]["shape"] = [shape[0], 1, *shape[1:]]
        five.note += ", 5-d pixel_values"
        out.append(five)
    return out


def _grid_candidates(params: set[str], config: Any, image_token: int) -> list[Candidate]:
    """Qwen2-VL-style inputs: flattened patches, a (t, h, w) grid per image, merged tokens in the ids."""
    side, width = _patch_geometry(config)
    n = 4  # a side of 2 x merge patches merges to a 2x2 square of tokens
    start, end = _sub(config, "vision_start_token_id"), _sub(config, "vision_end_token_id")
    prefix = [start] if isinstance(start, int) else []
    suffix = [end] if isinstance(end, int) else []
    length = len(prefix) + n + len(suffix) + 8
    cand = _text_candidate(params, config, length)
    cand.inputs["input_ids"] = {
        "dtype": "int64",
        "shape": [2, length],
        "placeholder": {"token": image_token, "count": n, "prefix": prefix, "suffix": suffix},
    }
    cand.inputs["pixel_values"] = {
        "dtype": "float32",
        "shape": [2 * side * side, width],
        "init": "rand",
    }
    cand.inputs["image_grid_thw"] = {"dtype": "int64", "values": [[1, side, side], [1, side, side]]}
    if "mm_token_type_ids" in params:
        cand.inputs["mm_token_type_ids"] = {"dtype": "int64", "shape": [2, length], "types_of": image_token}
        cand.grow["mm_token_type_ids"] = {"axis": 1, "by": 5, "fill": 0}
    cand.generate_exclude = []
    cand.note = f"grid {side}x{side}, {n} image tokens"
    return [cand]


def _patch_geometry(config: Any) -> tuple[int, int]:
    """(side of a 2x-merge grid, flattened patch width) of a Qwen2-VL-style vision tower."""
    vision = _vision_config(config)
    patch = _int(getattr(vision, "patch_size", None), 14)
    temporal = _int(getattr(vision, "temporal_patch_size", 1), 1)
    channels = _int(_sub(vision, "in_channels", "num_channels", "in_chans"), 3)
    merge = _int(getattr(vision, "spatial_merge_size", 2), 2)
    return 2 * merge, channels * temporal * patch * patch


def _vision_tower_candidate(config: Any) -> Candidate:
    """A Qwen2-VL-style vision tower on its own: flattened patches of two images and their (t, h, w) grids."""
    side, width = _patch_geometry(config)
    inputs = {
        "hidden_states": {"dtype": "float32", "shape": [2 * side * side, width], "init": "rand"},
        "grid_thw": {"dtype": "int64", "values": [[1, side, side], [1, side, side]]},
    }
    return Candidate(inputs, {}, [], f"grid {side}x{side}")


def _audio_candidates(kind: str, params: set[str], config: Any) -> list[Candidate]:
    out = []
    exclude: list[str] = []
    if "input_features" in params:
        names = ("num_mel_bins", "feature_size", "input_feat_per_channel", "n_mels")
        audio = _sub(config, "audio_config")  # a composite's audio tower states them there (Voxtral Realtime)
        mels = _int(_sub(config, *names) or (_sub(audio, *names) if _is_config(audio) else None), 80)
        channels = _int(getattr(config, "input_channels", 1), 1)
        source = _int(getattr(config, "max_source_positions", 0), 0)
        frames = 2 * source if 0 < source <= 512 else 64
        layouts = (("mel-first", [2, mels, frames], 2), ("time-first", [2, frames, mels * channels], 1))
        for layout, shape, axis in layouts:
            inputs: dict[str, Any] = {"input_features": {"dtype": "float32", "shape": shape, "init": "randn"}}
            grow: dict[str, Any] = (
                {} if source and frames == 2 * source else {"input_features": {"axis": axis, "by": 16, "fill": "randn"}}
            )
            if kind == "speech_seq2seq" or "decoder_input_ids" in params:
                exclude = _decoder(inputs, grow)
            out.append(Candidate(inputs, grow, exclude, layout))
    if "input_values" in params:
        inputs = {"input_values": {"dtype": "float32", "shape": [2, 4000], "init": "randn"}}
        grow = {"input_values": {"axis": 1, "by": 1600, "fill": "randn"}}
        exclude = _decoder(inputs, grow) if "decoder_input_ids" in params else []
        out.append(Candidate(inputs, grow, exclude, "waveform"))
        mels = _int(_sub(config, "num_mel_bins", "feature_size"), 0)
        if mels:  # spectrogram transformers take (batch, frames, mel bins) under the same name
            frames = min(_int(getattr(config, "max_length", 0), 64), 1024)
            spec = {"dtype": "float32", "shape": [2, frames, mels], "init": "randn"}
            out.append(Candidate({"input_values": spec}, {}, [], "spectrogram"))
    return out


_FEATURES = re.compile(
    r"mat1 and mat2 shapes cannot be multiplied \(\d+x\d+ and (\d+)x\d+\)|normalized_shape=\[(\d+)\]"
)


def _audio_retry(params: set[str], config: Any, exc: Exception, tried: set[int]) -> list[Candidate]:
    """Speech front ends whose feature width the config does not name plainly: take it from the error."""
    match = _FEATURES.search(str(exc))
    if not match or "input_features" not in params:
        return []
    width = int(match.group(1) or match.group(2))
    if width in tried or not 0 < width <= 4096:
        return []
    tried.add(width)
    out = []
    for shape, axis in (([2, 64, width], 1), ([2, width, 64], 2)):
        inputs: dict[str, Any] = {"input_features": {"dtype": "float32", "shape": shape, "init": "randn"}}
        grow: dict[str, Any] = {"input_features": {"axis": axis, "by": 16, "fill": "randn"}}
        exclude = _decoder(inputs, grow) if "decoder_input_ids" in params else []
        out.append(Candidate(inputs, grow, exclude, f"{width} features"))
    return out


# --- checking -----------------------------------------------------------------------------------------------------


@dataclass
class GenResult:
    """The outcome for one model type: an entry (built, ran, generated) or the reason there is none."""

    model_type: str
    family: str
    entry: dict[str, Any] | None
    reason: str = ""


def error_line(exc: BaseException) -> str:
    """The error's first line; an empty message (bare ImportError...) gets the raising frame instead."""
    message = str(exc).strip()
    if not message:
        frames = traceback.extract_tb(exc.__traceback__)
        message = f"(no message) at {Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "(no message)"
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    # A validator's first line ends with ":" and names nothing: the next line says what failed.
    text = " ".join(lines[:2]) if lines[0].endswith(":") and len(lines) > 1 else lines[0]
    return f"{type(exc).__name__}: {text}"[:400]


_MISMATCH = re.compile(r"tokens:?\s*(\d+),?\s*features:?\s*(\d+)")


def _materialise_placeholders(entry: dict[str, Any], text_range: tuple[int, int], avoid: set[int]) -> None:
    """Turn a ``placeholder`` id spec into literal ``values``: image tokens first, then seeded text ids."""
    gen = torch.Generator().manual_seed(0)
    allowed = torch.tensor([i for i in range(*text_range) if i not in avoid])
    for spec in entry["sample"]["inputs"].values():
        ph = spec.pop("placeholder", None)
        if ph is None:
            continue
        batch, length = spec.pop("shape")
        head = [*ph.get("prefix", []), *[ph["token"]] * ph["count"], *ph.get("suffix", [])]
        rows = []
        for _ in range(batch):
            tail = ph.get("tail", [])
            text = allowed[torch.randint(len(allowed), (length - len(head) - len(tail),), generator=gen)].tolist()
            rows.append(head + text + tail)
        spec["values"] = rows
        for other in entry["sample"]["inputs"].values():
            if other.get("types_of") == ph["token"]:  # mm_token_type_ids: 1 on image tokens, 0 elsewhere
                other.pop("types_of")
                other.pop("shape")
                other["values"] = [[int(x == ph["token"]) for x in row] for row in rows]


def _max_length(config: Any) -> int | None:
    """The longest sequence the config allows (positions tables), the bound of long shape checks."""
    found: list[int] = []

    def walk(cfg: Any) -> None:
        for key in ("max_position_embeddings", "n_positions", "max_target_positions", "n_ctx"):
            value = getattr(cfg, key, None)
            if isinstance(value, int) and value > 0:
                found.append(value)
        for value in vars(cfg).values():
            if _is_config(value):
                walk(value)

    walk(_text_config(config))
    return min(found) if found else None


def _leaf(outputs: Any, name: str) -> tuple[str, torch.Tensor]:
    keys = list(outputs.keys()) if hasattr(outputs, "keys") else []
    for key in (name, "logits", "last_hidden_state", *keys):
        value = outputs.get(key) if keys else None
        if isinstance(value, torch.Tensor):
            return key, value
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        return "0", first
    raise TypeError(f"no tensor output among {keys or type(outputs).__name__}")


MAX_PARAMS = 60_000_000


def _check_size(loaded: CorpusEntry) -> None:
    """Count parameters on the meta device first: a config that stays big must not allocate gigabytes."""
    import transformers
    from transformers import CONFIG_MAPPING

    cfg = CONFIG_MAPPING[loaded.model_type].from_dict(loaded.config)
    with torch.device("meta"):
        model = getattr(transformers, loaded.auto_class).from_config(cfg)
    n = sum(p.numel() for p in model.parameters())
    if n > MAX_PARAMS:
        raise ValueError(f"{n} parameters after shrinking (cap {MAX_PARAMS})")


# The longest waveform sample `_lengthen_waveform` looks for (one second at 16 kHz).
_MAX_WAVEFORM = 16000


def _derived_length(model: torch.nn.Module, samples: int) -> int | None:
    """The frame count the model's feature extractor makes of `samples` waveform samples (its own
    `_get_feat_extract_output_lengths`), or None where the model has no such method or it fails."""
    method = getattr(model, "_get_feat_extract_output_lengths", None)
    if method is None:
        return None
    try:
        return int(method(torch.tensor(samples)))
    except Exception:  # signatures vary (whisper's takes feature frames, some need adapters): not a waveform front end
        return None


def _lengthen_waveform(entry: dict[str, Any], seed: int = 0) -> int | None:
    """Lengthen a waveform sample (`input_values` [batch, samples]) until the feature extractor gives every
    derived axis >= 2 frames; return the new length, or None when the sample is already long enough or the
    model says nothing about its frames.

    torch.export specialises a size-1 axis of the sample (`size-one-derived-axis-sample`): moonshine's tester
    sample of 1000 samples leaves its encoder one frame (conv strides 64, 3, 2), so every exported program
    took one frame only; 1279 samples give two. Inputs sized like the waveform on that axis (its
    attention_mask) are lengthened with it."""
    inputs = entry["sample"]["inputs"]
    spec = inputs.get("input_values")
    shape = spec.get("shape") if isinstance(spec, dict) else None
    if not shape or len(shape) != 2:
        return None
    model = entry_from_dict(entry).build_model(seed)
    samples = shape[1]
    frames = _derived_length(model, samples)
    if frames is None or frames >= 2:
        return None
    longer = next((n for n in range(samples + 1, _MAX_WAVEFORM + 1) if (_derived_length(model, n) or 0) >= 2), None)
    if longer is None:
        return None
    for other in inputs.values():
        other_shape = other.get("shape") if isinstance(other, dict) else None
        if other_shape and len(other_shape) == 2 and other_shape[1] == samples:
            other_shape[1] = longer
    return longer


def verify_entry(entry: dict[str, Any], generative: bool, seed: int = 0) -> dict[str, Any]:
    """Build, run and (generative) generate through ``CorpusEntry``, exactly as the corpus users will."""
    start = time.perf_counter()
    loaded = entry_from_dict(entry)
    _check_size(loaded)
    model = loaded.build_model(seed)
    inputs = loaded.sample_inputs()
    with torch.no_grad():
        key, out = _leaf(model(**inputs), entry.get("output", "logits"))
    record: dict[str, Any] = {
        "model_class": type(model).__name__,
        "n_params": sum(p.numel() for p in model.parameters()),
        "output": key,
        "output_shape": list(out.shape),
    }
    if entry["sample"].get("grow"):
        try:
            with torch.no_grad():
                model(**loaded.grown_inputs())
        except Exception as exc:  # the sample stays; only the grow spec goes, with the reason kept
            record["grow_rejected"] = [error_line(exc)]
    if generative:
        exclude = set(entry["sample"].get("generate_exclude", []))
        gen_inputs = {k: v for k, v in inputs.items() if k not in exclude}
        with torch.no_grad():
            tokens = model.generate(**gen_inputs, max_new_tokens=3, do_sample=False)
        tokens = tokens if isinstance(tokens, torch.Tensor) else tokens.sequences
        record["generate_shape"] = list(tokens.shape)
    record["verify_seconds"] = round(time.perf_counter() - start, 2)
    return record


def _entry(model_type: str, family: Family, auto_class: str, config: Any, cand: Candidate, source: str) -> dict:
    ids: set[int] = set()
    _collect_ids(config, ids)
    vocab = _int(getattr(_text_config(config), "vocab_size", None), TEXT_VOCAB)
    text_range = (0, min(vocab, TEXT_VOCAB))
    entry = {
        "model_type": model_type,
        "family": family.name,
        "auto_class": auto_class,
        "config": config.to_dict(),
        "sample": {
            "inputs": copy.deepcopy(cand.inputs),
            "grow": copy.deepcopy(cand.grow),
            "text_range": list(text_range),
            "avoid_ids": sorted(i for i in ids if i < text_range[1]),
            "generate_exclude": list(cand.generate_exclude),
            "batch": 2,
            "dropped_inputs": [],
        },
        "source": source,
        "output": family.output,
    }
    max_length = _max_length(config)
    if max_length:
        entry["sample"]["max_length"] = max_length
    _materialise_placeholders(entry, text_range, set(entry["sample"]["avoid_ids"]))
    return entry


def _forward_params(auto_class: str, config: Any) -> set[str]:
    import transformers

    cls = getattr(transformers, auto_class)._model_mapping[type(config)]
    cls = cls[0] if isinstance(cls, (tuple, list)) else cls  # a mapping may list several classes; first wins
    return set(inspect.signature(cls.forward).parameters)


def _try_level(
    model_type: str, family: Family, auto_class: str, level: int, fill_none: bool = False, wide: bool = False
) -> tuple[dict | None, str]:
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    config = config_class(**shrink_config_kwargs(config_class, level, fill_none, wide))
    source = f"generated:shrink-level-{level}" + ("+fill-none" if fill_none else "") + ("+wide" if wide else "")
    return try_config(model_type, family, auto_class, config, source)


def try_config(model_type: str, family: Family, auto_class: str, config: Any, source: str) -> tuple[dict | None, str]:
    """The entry of one config: the family's fixes to the config, then the first input candidate that builds,
    runs and (generative families) generates; else None and the errors seen."""
    if getattr(config, "is_encoder_decoder", False) and getattr(config, "decoder_start_token_id", None) is None:
        # T5-style models start decoding from the pad token; without one set, generate() refuses to start.
        pad = getattr(config, "pad_token_id", None)
        config.decoder_start_token_id = pad if isinstance(pad, int) else 0
    if family.name == "causal_lm" and getattr(config, "is_decoder", None) is False:
        config.is_decoder = True  # encoders used as causal LMs (BertLMHeadModel, Reformer) must be decoders
    if family.name == "ctc" and getattr(config, "vocab_size", 0) is None:
        config.vocab_size = 32  # a CTC head needs a vocabulary; some speech configs leave it unset
    if auto_class == "AutoModelForSequenceClassification" and getattr(config, "pad_token_id", 0) is None:
        # Sequence classification finds each row's last token through the pad id: batches need one.
        eos = getattr(config, "eos_token_id", None)
        config.pad_token_id = eos if isinstance(eos, int) else 0
    text = _text_config(config)
    if auto_class == "AutoModelForSequenceClassification" and text is not config and text.pad_token_id is None:
        # Composite configs (Qwen3.5) are asked through get_text_config(): the text config needs the pad id.
        eos = getattr(text, "eos_token_id", None)
        text.pad_token_id = eos if isinstance(eos, int) else 0
    languages = getattr(config, "languages", None)
    if isinstance(languages, (list, tuple)) and languages and getattr(config, "default_language", 0) is None:
        config.default_language = languages[0]  # X-MOD refuses to run without a language adapter chosen
    params = _forward_params(auto_class, config)
    cands = candidates(family.kind, params, config)
    if not cands:
        return None, f"no known input among forward parameters {sorted(params)[:12]}"
    errors: list[str] = []
    queue = list(cands)
    tried_counts: set[int] = set()
    tried_widths: set[int] = set()
    while queue:
        cand = queue.pop(0)
        entry = _entry(model_type, family, auto_class, config, cand, source)
        try:
            _lengthen_waveform(entry)
            entry.update(verify_entry(entry, family.generative))
            return entry, ""
        except Exception as exc:
            errors.append(error_line(exc))
            match = _MISMATCH.search(str(exc))
            if family.kind == "vlm" and match and int(match.group(2)) % 2 == 0:
                per_sample = int(match.group(2)) // 2
                if per_sample not in tried_counts and 0 < per_sample <= 4096:
                    tried_counts.add(per_sample)
                    queue = _vlm_candidates(params, config, per_sample) + queue
            if family.kind in {"audio", "speech_seq2seq"}:
                queue = _audio_retry(params, config, exc, tried_widths) + queue
    return None, errors[0] if len(set(errors)) == 1 else " | ".join(dict.fromkeys(errors))


TESTER_CONFIGS = Path(__file__).with_name("tester_configs.json")


@functools.cache
def tester_configs() -> dict[str, list[dict[str, Any]]]:
    """``{model_type: [{tester, config_class, kwargs, dropped}]}``: the tiny configs of transformers' own model
    testers, extracted by ``tools/extract_tester_configs.py`` (read-only)."""
    if not TESTER_CONFIGS.exists():
        return {}
    return json.loads(TESTER_CONFIGS.read_text()).get("types", {})


def tester_config(model_type: str, record: dict[str, Any]) -> Any:
    """The config a tester record describes, built by the installed class of ``model_type``."""
    from transformers import CONFIG_MAPPING

    kwargs = copy.deepcopy(record["kwargs"])
    config = CONFIG_MAPPING[model_type](**kwargs)
    return config


def _attempt(make: Any) -> tuple[dict | None, str]:
    """``make()``'s (entry, reason), with an exception it raises as the reason."""
    try:
        return make()
    except Exception as exc:
        return None, error_line(exc)


def _try_tester(model_type: str, family: Family, auto_class: str, record: dict[str, Any]) -> tuple[dict | None, str]:
    config = tester_config(model_type, record)
    return try_config(model_type, family, auto_class, config, f"tester:{record['tester']}")


def generate_entry(model_type: str, family: Family, auto_class: str, reuse: dict[str, Any] | None = None) -> GenResult:
    """An entry for one model type: a reused hand-made entry if it still verifies, else the first shrink level
    that builds, runs and generates (plain levels first, then None fields filled, then wide). Never raises: a
    failure comes back as ``reason``."""
    reasons: list[str] = []
    if reuse is not None and reuse.get("auto_class") == auto_class:
        entry = copy.deepcopy(reuse)
        entry["family"] = family.name
        entry["source"] = f"reused:{reuse.get('source', 'hand-made')}"
        try:
            longer = _lengthen_waveform(entry)
            if longer is not None:
                entry["source"] += f" (waveform lengthened to {longer} samples: every derived axis >= 2)"
            entry.update(verify_entry(entry, family.generative))
            return GenResult(model_type, family.name, entry)
        except Exception as exc:
            reasons.append(f"reused entry: {error_line(exc)}")
    for record in tester_configs().get(model_type, []):
        # transformers' own tester config (tools/extract_tester_configs.py) before the generator's shrinking.
        entry, reason = _attempt(lambda r=record: _try_tester(model_type, family, auto_class, r))
        if entry is not None:
            return GenResult(model_type, family.name, entry)
        reasons.append(f"tester {record['tester'].partition('@')[0]}: {reason}")
    for level in (0, 1, 2, 3):
        entry, reason = _attempt(lambda lv=level: _try_level(model_type, family, auto_class, lv))
        if entry is not None:
            return GenResult(model_type, family.name, entry)
        reasons.append(f"level {level}: {reason}")
    # Only then the levels again with the None size fields filled (`_fill_none`): a type that builds without
    # them keeps the entry it always had.
    for level in (0, 1, 2):
        try:
            from transformers import CONFIG_MAPPING

            config_class = CONFIG_MAPPING[model_type]
            if shrink_config_kwargs(config_class, level, True) == shrink_config_kwargs(config_class, level):
                continue
        except Exception:  # no kwargs at all (unknown type, defaults rejected): the plain levels said why
            continue
        try:
            entry, reason = _try_level(model_type, family, auto_class, level, fill_none=True)
        except Exception as exc:
            entry, reason = None, error_line(exc)
        if entry is not None:
            return GenResult(model_type, family.name, entry)
        reasons.append(f"level {level} (None fields filled): {reason}")
    # Last, the most-shrunk level 4x wider (`_widen`): sizes some models only keep consistent from 64 up.
    try:
        from transformers import CONFIG_MAPPING

        config_class = CONFIG_MAPPING[model_type]
        if shrink_config_kwargs(config_class, 0, wide=True) == shrink_config_kwargs(config_class, 0):
            return GenResult(model_type, family.name, None, " || ".join(reasons))
    except Exception:  # no kwargs at all: the plain levels said why
        return GenResult(model_type, family.name, None, " || ".join(reasons))
    try:
        entry, reason = _try_level(model_type, family, auto_class, 0, wide=True)
    except Exception as exc:
        entry, reason = None, error_line(exc)
    if entry is not None:
        return GenResult(model_type, family.name, entry)
    reasons.append(f"level 0 wide: {reason}")
    return GenResult(model_type, family.name, None, " || ".join(reasons))
