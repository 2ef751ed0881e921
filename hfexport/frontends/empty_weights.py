"""Models whose weights hold no memory, for the low-memory export (`OnnxConfig(low_memory=True)`).

`empty_model(folder)` builds the model of a checkpoint folder from its config under a `FakeTensorMode`: every
parameter and persistent buffer is a FakeTensor (a shape, a dtype and the CPU device, no storage), so
torch.export captures the full-size graph without allocating a byte of weights. Non-persistent buffers are not
in the checkpoint (rotary `inv_freq`, computed from the config): they are small, and are computed for real by
the model's own `_init_weights` (what `from_pretrained` does for them), so they become ordinary initializers.

`weight_sources(model, checkpoint)` maps every weight name the exported program may use (a tied weight has
several: `lm_head.weight` and `model.embed_tokens.weight`) to the checkpoint tensor that holds its values.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from hfexport.core.checkpoints import Checkpoint
from hfexport.core.errors import InputError


def is_empty(tensor: torch.Tensor) -> bool:
    """Whether `tensor` has no values: a FakeTensor or a tensor on the meta device."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor) or tensor.device.type == "meta"


def _non_persistent_buffers(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Module, str]]:
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name in list(module._buffers):
            if name in module._non_persistent_buffers_set and module._buffers[name] is not None:
                yield (f"{module_name}.{name}" if module_name else name), module, name


def _materialise_non_persistent_buffers(model: Any) -> None:
    """Compute the non-persistent buffers for real with the model's `_init_weights` (as `from_pretrained` does).

    Each is first filled with a sentinel (NaN, or the dtype's minimum for integers); one that `_init_weights`
    leaves at the sentinel has no known value, and the model is refused rather than exported with garbage.
    """
    owners: dict[int, torch.nn.Module] = {}
    filled: list[tuple[str, torch.nn.Module, str]] = []
    for full_name, module, name in _non_persistent_buffers(model):
        buffer = module._buffers[name]
        assert buffer is not None
        if not is_empty(buffer):
            continue
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            if buffer.dtype.is_floating_point:
                real = torch.full(tuple(buffer.shape), math.nan, dtype=buffer.dtype)
            else:
                real = torch.full(tuple(buffer.shape), _sentinel(buffer.dtype), dtype=buffer.dtype)
        module._buffers[name] = real
        owners[id(module)] = module
        filled.append((full_name, module, name))
    init = getattr(model, "_init_weights", None)
    if init is None and filled:
        raise InputError(f"{type(model).__name__} has no _init_weights to compute its buffer {filled[0][0]!r}")
    for module in owners.values():
        with torch.no_grad():
            init(module)
    for full_name, module, name in filled:
        value = module._buffers[name]
        assert value is not None
        unset = value.isnan() if value.dtype.is_floating_point else value == _sentinel(value.dtype)
        if bool(unset.any()):
            raise InputError(
                f"the buffer {full_name!r} of {type(model).__name__} is neither in the checkpoint nor computed by "
                "its _init_weights: its value is unknown without building the model for real, so the low-memory "
                "export cannot write it; export without low_memory"
            )


def _sentinel(dtype: torch.dtype) -> int | bool:
    return False if dtype == torch.bool else torch.iinfo(dtype).min


def empty_model(
    folder: str | Path,
    auto_class: str = "AutoModelForCausalLM",
    *,
    dtype: torch.dtype | None = None,
    trust_remote_code: bool = False,
    **config_overrides: Any,
) -> Any:
    """The model of checkpoint `folder` built from its config with FakeTensor weights (no memory), in eval mode.

    `dtype` is the dtype the export computes in (the checkpoint's values are cast to it while streaming);
    `config_overrides` change the config (e.g. `num_hidden_layers=2` for a reduced-depth check). The model
    remembers `folder` (`name_or_path`), where the low-memory export reads the weights from.
    """
    import transformers
    from torch._subclasses.fake_tensor import FakeTensorMode

    folder = Path(folder)
    config = transformers.AutoConfig.from_pretrained(
        folder, local_files_only=True, trust_remote_code=trust_remote_code, **config_overrides
    )
    options: dict[str, Any] = {"trust_remote_code": trust_remote_code}
    if dtype is not None:
        options["dtype"] = dtype
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = getattr(transformers, auto_class).from_config(config, **options)
    model.eval()
    _materialise_non_persistent_buffers(model)
    model.name_or_path = str(folder)
    return model


def weight_sources(model: torch.nn.Module, checkpoint: Checkpoint) -> dict[str, str]:
    """{weight name: checkpoint tensor name} for every empty parameter and persistent buffer of `model`.

    Every alias of a tied weight maps to the one checkpoint tensor that holds it (save_pretrained writes one of
    them). A weight the checkpoint lacks, or holds with another shape, is refused here, before any trace.
    """
    names_of: dict[int, list[str]] = {}
    tensors: dict[int, torch.Tensor] = {}
    named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
    non_persistent = {full for full, _, _ in _non_persistent_buffers(model)}
    for name, tensor in named:
        if name in non_persistent or not is_empty(tensor):
            continue
        names_of.setdefault(id(tensor), []).append(name)
        tensors[id(tensor)] = tensor
    renamed: dict[str, str] | None = None  # built only when a weight is not in the checkpoint under its name
    converted: dict[str, str] = {}
    sources: dict[str, str] = {}
    for key, names in names_of.items():
        found = [name for name in names if name in checkpoint]
        if not found:
            if renamed is None:
                renamed, converted = load_time_renames(model, checkpoint)
            found = [renamed[name] for name in names if name in renamed]
        if not found:
            raise InputError(_missing(names[0], model, checkpoint, converted))
        info = checkpoint.tensors[found[0]]
        shape = tuple(tensors[key].shape)
        if info.shape != shape:
            raise InputError(
                f"the checkpoint tensor {found[0]!r} has shape {list(info.shape)}, the model's weight {list(shape)}"
            )
        for name in names:
            sources[name] = found[0]
    return sources


def load_time_renames(model: Any, checkpoint: Checkpoint) -> tuple[dict[str, str], dict[str, str]]:
    """The checkpoint keys `from_pretrained` renames, by transformers' own mapping for `model`
    (`conversion_mapping.get_model_conversion_mapping`: its model-type renames and conversions, the legacy
    `LayerNorm.gamma`/`beta` names, and the base-model prefix added or dropped, through
    `core_model_loading.rename_source_key`).

    Returns ({model key: checkpoint key} for 1:1 renames, whose tensor is the weight unchanged, and
    {checkpoint key: converter} for keys that a `WeightConverter` turns into weights by an operation (experts
    stacked, a fused qkv split), which one checkpoint tensor per weight cannot stream)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta = dict.fromkeys(model.state_dict(), True)
    prefix = getattr(model, "base_model_prefix", None) or None
    renamed: dict[str, str] = {}
    converted: dict[str, str] = {}
    for key in checkpoint.tensors:
        target, pattern = rename_source_key(key, renamings, converters, prefix, meta)
        if pattern is not None:
            converter = next((c for c in converters if pattern in c.source_patterns), None)
            operations = ", ".join(type(op).__name__ for op in getattr(converter, "operations", []))
            converted[key] = f"{target!r} from {pattern!r} by {operations or 'a conversion'}"
        elif target != key:
            renamed.setdefault(target, key)
    return renamed, converted


def _missing(name: str, model: Any, checkpoint: Checkpoint, converted: dict[str, str]) -> str:
    where = f"the weight {name!r} of {type(model).__name__} is not in the checkpoint {checkpoint.folder}"
    if converted:
        # The conversion that builds this weight, when one does; else any, as an example.
        key, how = next(
            ((k, v) for k, v in converted.items() if v.startswith(f"{name!r}")), next(iter(converted.items()))
        )
        return (
            f"{where}: transformers builds weights of this model from checkpoint tensors by a conversion that is not "
            f"a rename (e.g. {how}, reading {key!r}; {len(converted)} checkpoint tensor(s) so converted), and the "
            "low-memory export streams one checkpoint tensor per weight; export without low_memory"
        )
    return (
        f"{where}, under that name or a name transformers renames at load time (its conversion mapping, legacy "
        "names, the base-model prefix)"
    )
