"""Variants of a corpus entry: other configs of the same model type, chosen to take the branches its code has.

A corpus entry is one config per type, and the export rules were fixed for that config. The modeling code
branches on its config (`hfexport.testing.config_branches`): a MoE block loops over experts that may receive
no token, MLA splits heads into rope and no-rope parts of config-given sizes, windows and chunks may be
shorter or longer than the input, layer kinds alternate by `layer_types`. Each variant changes one such
attribute of the entry's config (the rest, inputs included, stays), and is named `<type>@<attr>=<value>`:

- windows and chunks (`*window*`, `*chunk_size*`, ...): 3 (shorter than the 8-token sample, dividing neither it
  nor the 13-token grown input) and 12 (longer than the sample, shorter than the grown input);
- experts: `many-experts` (48 experts for 16 tokens x top-2: most experts get no token), top-k 1 and top-k =
  every expert; shared experts on/off;
- MLA (`qk_rope_head_dim` / `qk_nope_head_dim`): an unequal rope/no-rope split (4/12), `v_head_dim` 8;
- attention layout: one kv head (MQA) or as many as query heads (MHA); a `head_dim` decoupled from the width;
- `layer_types`: every layer of one kind, for each kind the code compares with;
- each boolean the code branches on flipped (`tie_word_embeddings` included), each attribute tested against
  None set or unset, each string compared with a literal set to that literal, each integer compared in a
  condition set to 0 (or 1);

at most `MAX_VARIANTS` per type, in that order. A variant that transformers refuses or that does not run in
eager is not a config a user can have: it is listed with its error, not counted.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .config_branches import BranchSite, branch_sites
from .corpus_gen import SIZE_KEYS

__all__ = ["MAX_VARIANTS", "Variant", "apply_variant", "propose_variants"]

MAX_VARIANTS = 12
SHORT_WINDOW, LONG_WINDOW = 3, 12  # the sample is 8 tokens, the grown input 13
MANY_EXPERTS = 48  # the sample routes 2 x 8 tokens to top-2: 32 picks, so most of 48 experts get none
_WINDOW = re.compile(r"(window|chunk_size|chunk_length|attention_chunk|local_attention)")
_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "num_routed_experts")
_TOPK = ("num_experts_per_tok", "moe_topk", "num_experts_per_token", "top_k", "moe_k")
_SHARED = ("n_shared_experts", "num_shared_experts")
# Sizes (widths, depths, heads, positions, vocabularies): varied by the attention-layout variants, never by the
# generic integer rule (a width of 0 is no config).
_SIZES = SIZE_KEYS
# Flags about how a model is used (encoder/decoder role, caching), not about its architecture's code paths.
_ROLES = {"is_decoder", "is_encoder_decoder", "add_cross_attention", "use_cache", "tie_encoder_decoder"}


@dataclass(frozen=True)
class Variant:
    """One attribute (or a coupled group) of an entry's config set to other values."""

    name: str  # `<attr>=<value>` or a named group (`many-experts`, `mla-split`)
    changes: tuple[tuple[str, Any], ...]  # (attribute, value): set where the config tree has the attribute
    why: str


def _owners(config: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """The config dict and its nested config dicts (text_config, decoder, ...), the top first."""
    yield config
    for value in config.values():
        if isinstance(value, dict) and "model_type" in value:
            yield from _owners(value)


def _find(config: dict[str, Any], attr: str) -> tuple[dict[str, Any], Any] | None:
    for owner in _owners(config):
        if attr in owner:
            return owner, owner[attr]
    return None


def _value_name(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "+".join(dict.fromkeys(str(v) for v in value))
    return str(value)


def _set(name: str, why: str, **changes: Any) -> Variant:
    return Variant(name, tuple(changes.items()), why)


def _one(attr: str, value: Any, why: str) -> Variant:
    return Variant(f"{attr}={_value_name(value)}", ((attr, value),), why)


def _sites_by_attr(model_type: str) -> dict[str, list[BranchSite]]:
    out: dict[str, list[BranchSite]] = {}
    for sites in branch_sites(model_type).values():
        for site in sites:
            for attr in site.attrs:
                out.setdefault(attr, []).append(site)
    return out


def _none_value(attr: str) -> Any:
    """A value for an attribute the code tests against None and the entry leaves None."""
    if _WINDOW.search(attr):
        return SHORT_WINDOW
    if attr.endswith("_rank"):
        return 16
    if attr.endswith(("_dim", "_size")):
        return 8
    if attr.startswith(("num_", "n_")) or attr.endswith(("_heads", "_layers", "_experts")):
        return 2
    return None


def propose_variants(model_type: str, config: dict[str, Any]) -> list[Variant]:
    """The variants of one entry's config (`config`: the entry's config dict), at most `MAX_VARIANTS`."""
    sites = _sites_by_attr(model_type)
    found: list[Variant] = []

    def has(attr: str) -> bool:
        return _find(config, attr) is not None

    def value(attr: str) -> Any:
        hit = _find(config, attr)
        return hit[1] if hit else None

    # Windows and chunks: shorter and longer than the sample (wherever the config has one, used or not: the
    # masking and cache code reads them for every model).
    for owner in _owners(config):
        for attr, v in owner.items():
            if attr.startswith("_") or not _WINDOW.search(attr):
                continue
            if isinstance(v, int) and not isinstance(v, bool) and v > 0:
                for size in (SHORT_WINDOW, LONG_WINDOW):
                    if size != v:
                        found.append(_one(attr, size, f"{attr} {size}: a window/chunk vs the 8- and 13-token inputs"))
                if any(s.none_test for s in sites.get(attr, [])):
                    found.append(_one(attr, None, f"no {attr}: the `is None` side"))
    # Experts.
    experts = next((a for a in _EXPERTS if isinstance(value(a), int) and value(a) > 1), None)
    topk = next((a for a in _TOPK if isinstance(value(a), int) and value(a) > 0), None)
    if experts:
        found.append(
            _set(
                "many-experts",
                "more experts than the sample routes tokens to: experts with no token",
                **{experts: MANY_EXPERTS},
            )
        )
        if topk and value(topk) != 1:
            found.append(_one(topk, 1, "one expert per token"))
        if topk and value(topk) != value(experts):
            found.append(_one(topk, value(experts), "every expert for every token"))
        for attr in _SHARED:
            if isinstance(value(attr), int):
                found.append(_one(attr, 0 if value(attr) else 1, "shared experts off/on"))
    # MLA.
    if has("qk_rope_head_dim") and has("qk_nope_head_dim"):
        changes: dict[str, Any] = {"qk_rope_head_dim": 4, "qk_nope_head_dim": 12}
        if value("head_dim") == value("qk_rope_head_dim"):
            changes["head_dim"] = 4  # configs whose rotary tables are built for head_dim (DeepSeek-V3)
        if has("qk_head_dim"):
            changes["qk_head_dim"] = 16
        found.append(_set("mla-split", "rope and no-rope parts of unequal size", **changes))
        if "head_dim" in changes:
            # The same split with head_dim left as it was: rotary tables wider than the rope part, where the
            # model allows it (SarvamMLA, BailingHybrid, DeepSeek-V3.2).
            untied = {k: v for k, v in changes.items() if k != "head_dim"}
            found.append(_set("mla-split-untied", "rope part narrower than head_dim", **untied))
        if isinstance(value("v_head_dim"), int) and value("v_head_dim") != 8:
            found.append(_one("v_head_dim", 8, "value heads narrower than query/key heads"))
    # Attention layout.
    heads, kv = value("num_attention_heads"), value("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int):
        for target in (1, heads):
            if target != kv:
                found.append(_one("num_key_value_heads", target, "MQA" if target == 1 else "MHA"))
    hidden, head_dim = value("hidden_size"), value("head_dim")
    if isinstance(hidden, int) and isinstance(heads, int) and heads and head_dim == hidden // heads:
        found.append(_one("head_dim", max(4, head_dim // 2), "heads narrower than width / heads"))
    # Layer kinds.
    kinds = value("layer_types")
    if isinstance(kinds, list) and kinds and all(isinstance(k, str) for k in kinds):
        compared = {lit for s in sites.get("layer_types", []) for lit in s.literals if "attention" in lit}
        for kind in sorted(set(kinds) | compared):
            if set(kinds) != {kind}:
                found.append(_one("layer_types", [kind] * len(kinds), f"every layer {kind}"))
    # Generic: booleans, None tests, string literals, integers in conditions.
    if isinstance(value("tie_word_embeddings"), bool):
        found.append(_one("tie_word_embeddings", not value("tie_word_embeddings"), "tied/untied output embedding"))
    done = {name for v in found for name, _ in v.changes} | _SIZES | _ROLES
    for attr in sorted(sites):
        if attr in done or not has(attr) or attr.endswith(("_token_id", "_token_ids", "_token_index")):
            continue  # token ids pick the sample's special tokens, not a code path
        current = value(attr)
        conditions = [s for s in sites[attr] if s.kind in {"if", "ifexp", "while"}]
        if not conditions:
            continue
        if isinstance(current, bool):
            found.append(_one(attr, not current, "the other side of a boolean branch"))
        elif any(s.none_test for s in conditions):
            # A number that can be off (`q_lora_rank`), or a None given a value; never None for a string or a
            # structure (an activation name, rope parameters: transformers fills those in).
            if current is None and _none_value(attr) is not None:
                found.append(_one(attr, _none_value(attr), "the `is not None` side of a branch"))
            elif isinstance(current, (int, float)):
                found.append(_one(attr, None, "the `is None` side of a branch"))
        elif isinstance(current, str):
            literals = [lit for s in conditions for lit in s.literals if lit != current]
            for lit in list(dict.fromkeys(literals))[:2]:
                found.append(_one(attr, lit, f"the `== {lit!r}` branch"))
        elif isinstance(current, int) and not isinstance(current, bool):
            if any(s.kind == "div" for s in sites[attr]):
                # A divisor (`(layer_idx + 1) % decoder_sparse_step`): another period, never 0.
                found.append(_one(attr, current + 1 if current > 1 else 2, "another period of an integer condition"))
            elif not attr.endswith(("_heads", "_dim", "_size", "_layers")):
                found.append(_one(attr, 0 if current else 1, "the other side of an integer condition"))
    unique: dict[str, Variant] = {}
    for variant in found:
        unique.setdefault(variant.name, variant)
    return list(unique.values())[:MAX_VARIANTS]


def apply_variant(entry: dict[str, Any], variant: Variant) -> dict[str, Any]:
    """A copy of `entry` with the variant's changes set in its config (where the attribute lives) and named."""
    out = copy.deepcopy(entry)
    for attr, value in variant.changes:
        hit = _find(out["config"], attr)
        owner = hit[0] if hit else out["config"]
        owner[attr] = copy.deepcopy(value)
    out["variant"] = variant.name
    out["source"] = f"variant of {entry.get('source', '?')}: {variant.why}"
    for key in ("model_class", "n_params", "output_shape", "generate_shape", "verify_seconds", "grow_rejected"):
        out.pop(key, None)  # what the generator saw for the base config; the variant's own check rewrites it
    return out
