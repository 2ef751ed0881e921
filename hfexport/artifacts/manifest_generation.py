"""The check of a manifest's generation layout (`GenerationSpec.to_dict()`, the `generation` key).

`load` refuses a layout whose keys are not those of its dataclasses, or whose values are not of their types and
within bounds (a cache leaf no larger than the artifact's files), so that nothing fails, or allocates without
bound, inside `generate()`.
"""

from __future__ import annotations

import math
from typing import Any

from hfexport.artifacts.errors import ManifestError
from hfexport.artifacts.manifest_values import MAX_FILES, Lookups, check_keys, check_no_code, count_values

# dtype names a cache leaf may have: `torch.<name>` is a dtype (never any other attribute of torch).
_DTYPES = frozenset({"float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8", "uint8", "bool"})
_MAX_RANK = 8
_MAX_DIM = 1 << 31
_MAX_IDS = 1 << 20  # token id lists (suppress_tokens can be a large part of a vocabulary)


def _int(value: Any, where: str, low: int, high: int = _MAX_DIM, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
        null = " or null" if optional else ""
        raise ManifestError(f"{where} must be an integer in [{low}, {high}]{null}, got {value!r}")


def _bool(value: Any, where: str) -> None:
    if not isinstance(value, bool):
        raise ManifestError(f"{where} must be true or false, got {value!r}")


def _int_list(value: Any, where: str, low: int = 0, cap: int = _MAX_IDS) -> None:
    if not isinstance(value, list) or len(value) > cap:
        raise ManifestError(f"{where} must be a list of at most {cap} integers")
    for i, item in enumerate(value):
        _int(item, f"{where}[{i}]", low)


def _str_list(value: Any, where: str) -> None:
    if not isinstance(value, list) or len(value) > MAX_FILES or not all(isinstance(v, str) for v in value):
        raise ManifestError(f"{where} must be a list of names (strings)")


def _check_leaf(leaf: dict[str, Any], at: str, budget: int) -> None:
    """A cache leaf: a name, a torch dtype name, and a shape of at most `budget` elements (what the files hold)."""
    if not isinstance(leaf["name"], str):
        raise ManifestError(f"{at}.name must be a string")
    if leaf["dtype"] not in _DTYPES:
        raise ManifestError(f"{at}.dtype {leaf['dtype']!r} is not one of {sorted(_DTYPES)}")
    shape = leaf["shape"]
    if not isinstance(shape, list) or len(shape) > _MAX_RANK:
        raise ManifestError(f"{at}.shape must be a list of at most {_MAX_RANK} sizes")
    for i, size in enumerate(shape):
        _int(size, f"{at}.shape[{i}]", 0)
    if math.prod(shape) > budget:
        raise ManifestError(
            f"{at}.shape {shape} has {math.prod(shape)} elements, more than the artifact's files hold ({budget} "
            "bytes): a sample cache is never larger than the model"
        )


def _check_positions(positions: Any, where: str) -> None:
    """`MultimodalPositions.to_dict()`: exactly its keys and its blocks' keys, with values of their types."""
    if positions is None:
        return
    from hfexport.core.positions import MultimodalPositions, PositionBlock

    check_keys(positions, MultimodalPositions, where)
    if positions["type_key"] is not None and not isinstance(positions["type_key"], str):
        raise ManifestError(f"{where}.type_key must be a string or null")
    _int_list(positions["token_ids"], f"{where}.token_ids")
    _bool(positions["text_row"], f"{where}.text_row")
    _int(positions.get("decode_rows"), f"{where}.decode_rows", 1, _MAX_RANK, optional=True)
    blocks = positions.get("blocks", [])
    if not isinstance(blocks, list) or len(blocks) > MAX_FILES:
        raise ManifestError(f"{where}.blocks must be a list")
    for i, block in enumerate(blocks):
        at = f"{where}.blocks[{i}]"
        check_keys(block, PositionBlock, at)
        _int(block["token_type"], f"{at}.token_type", 0)
        _int(block["advance"], f"{at}.advance", -_MAX_DIM, optional=True)
        for key, kind in (("offsets", int), ("absolute", bool)):
            rows = block.get(key, [])
            if not isinstance(rows, list) or not all(
                isinstance(row, list) and all(type(v) is kind for v in row) for row in rows
            ):
                raise ManifestError(f"{at}.{key} must be a list of lists of {kind.__name__}")


def check_generation(
    spec: dict[str, Any] | None, components: dict[str, Any], lookups: Lookups, budget: int = _MAX_DIM
) -> None:
    """The generation layout (`GenerationSpec.to_dict()`): exactly the keys of its dataclasses, and every value
    of its type and within bounds (a cache leaf no larger than `budget` elements), so that `load` refuses what
    would otherwise fail, or allocate without bound, inside `generate()`."""
    if spec is None:
        return
    from hfexport.generation_spec import LAYOUT_MAX_NUMEL, CacheLeaf, ComponentSpec, GenerationSpec

    where = "manifest.generation"
    check_keys(spec, GenerationSpec, where)
    if not isinstance(spec["components"], dict) or set(spec["components"]) - set(components):
        raise ManifestError(f"{where}.components must describe components of this artifact")
    for name, comp in spec["components"].items():
        at = f"{where}.components[{name!r}]"
        check_keys(comp, ComponentSpec, at)
        if not isinstance(comp["inputs"], list) or not isinstance(comp["constants"], dict):
            raise ManifestError(f"{at}: inputs is a list, constants an object")
        _str_list(comp["inputs"], f"{at}.inputs")
        if any(isinstance(v, (dict, list)) for v in comp["constants"].values()):
            raise ManifestError(f"{at}.constants holds scalars only")
        _int(comp["mask_rank"], f"{at}.mask_rank", 0, _MAX_RANK, optional=True)
        layout = comp.get("layout", {})
        if not isinstance(layout, dict) or any(count_values(v) > LAYOUT_MAX_NUMEL * 3 for v in layout.values()):
            raise ManifestError(f"{at}.layout holds small integer tensors (at most {LAYOUT_MAX_NUMEL} values each)")
        nested = comp.get("leaves", {})
        if not isinstance(nested, dict) or len(nested) > MAX_FILES:
            raise ManifestError(f"{at}.leaves must be an object of name lists")
        for kwarg, names in nested.items():
            _str_list(names, f"{at}.leaves[{kwarg!r}]")
        if not isinstance(comp["cache_leaves"], list) or len(comp["cache_leaves"]) > MAX_FILES:
            raise ManifestError(f"{at}.cache_leaves must be a list")
        for i, leaf in enumerate(comp["cache_leaves"]):
            check_keys(leaf, CacheLeaf, f"{at}.cache_leaves[{i}]")
            _check_leaf(leaf, f"{at}.cache_leaves[{i}]", budget)
    if spec["cache_key"] is not None and not isinstance(spec["cache_key"], str):
        raise ManifestError(f"{where}.cache_key must be a string or null")
    flags = ("static_cache", "multi_token_decode", "is_encoder_decoder", "mask_current_only", "decode_full_sequence")
    for key in flags:
        if key in spec:
            _bool(spec[key], f"{where}.{key}")
    _int(spec["max_cache_len"], f"{where}.max_cache_len", 1, optional=True)
    _int(spec["sample_batch"], f"{where}.sample_batch", 1)
    for key in ("pad_token_id", "decoder_start_token_id", "forced_bos_token_id"):
        _int(spec.get(key), f"{where}.{key}", 0, optional=True)
    for key in ("eos_token_id", "forced_eos_token_id", "suppress_tokens", "begin_suppress_tokens"):
        _int_list(spec.get(key, []), f"{where}.{key}")
    _str_list(spec.get("encoder_output_fields", []), f"{where}.encoder_output_fields")
    _check_positions(spec.get("positions"), f"{where}.positions")
    check_no_code(spec, where, lookups)
