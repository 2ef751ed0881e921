"""Capture a model with `torch.export.export`.

The steps, in order: validate the sample inputs and dynamic shapes (before touching the model), register
cache pytrees, derive dynamic shapes, prepare the model for the trace (eval mode, an exportable attention
implementation, stateful caches cleared, an explicit forward signature), install the `patch` rules, trace,
undo everything, and run the `fx` rules on the program. The caller's model and inputs are never changed.
"""

from __future__ import annotations

import inspect
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from hfexport.core.cache_classes import is_model_cache_class
from hfexport.core.cache_pytree import cache_dynamic_shapes, flatten_cache, register_cache_pytrees, unflatten_cache
from hfexport.core.errors import InputError
from hfexport.frontends.multimodal import bake_layout, is_vision_tower, pixel_layouts, specialised_image_axes
from hfexport.generation_spec import IMAGE_COUNT_META, LAYOUT_META, STATIC_AXES_META, LayoutSpecialised
from hfexport.rewrites import engine
from hfexport.rewrites.engine import RewriteContext

logger = logging.getLogger(__name__)

# Attention implementations that torch.export can trace as they are, and those switched to SDPA for the
# trace because their kernels are not exportable on any backend.
_EXPORTABLE_ATTENTION = ("eager", "sdpa")
_SWITCHED_ATTENTION = re.compile(r"^(flash_attention_\d|flex_attention|kernels-community/.*flash.*)$")
# Module attributes that memoise a tensor from an earlier eager call (e.g. `cached_rotary_positional_embedding`):
# a real tensor captured into the trace would be baked in as a constant, and a FakeTensor left behind would
# break the next eager call.
_STATEFUL_ATTRIBUTE = re.compile(r"(^|_)cached(_|$)")


@dataclass(frozen=True)
class CaptureOptions:
    dynamic: bool = False
    dynamic_shapes: Mapping[str, Any] | None = None
    strict: bool = False
    prefer_deferred_runtime_asserts_over_guards: bool = False
    # Trace the float32 function of a bf16 model: bf16 weights, buffers and inputs are float32 for the trace
    # (hfexport/exporters/preflight.py decides, for a runtime without bf16 kernels).
    upcast_bfloat16: bool = False
    # `dynamic_shapes` derived by the backend from `dynamic=True` (ExecuTorch's capped axes), not the caller's:
    # read like `dynamic=True`'s own shapes (an image axis the trace fixes is recorded as the image count).
    derived_shapes: bool = False


def _is_cache(value: Any) -> bool:
    """A transformers `Cache`, or a cache class a modeling module defines outside its hierarchy (xLSTM's
    `xLSTMCache`: `is_model_cache_class`), which the cache pytree flattens the same way."""
    try:
        from transformers.cache_utils import Cache
    except ImportError:  # pragma: no cover - transformers is a hard dependency
        return False
    return isinstance(value, Cache) or is_model_cache_class(type(value))


def _is_model_output(value: Any) -> bool:
    from transformers.utils import ModelOutput

    return isinstance(value, ModelOutput)


def _tensor_tree(value: Any) -> bool:
    """A non-empty pytree of dicts, ModelOutputs, tuples and lists whose leaves are all tensors."""
    leaves = torch.utils._pytree.tree_leaves(value)
    return bool(leaves) and all(isinstance(leaf, torch.Tensor) for leaf in leaves)


def _tree_shapes(value: Any, every_axis: Any) -> Any:
    """Dynamic shapes mirroring a pytree of tensors; torch.export matches a ModelOutput's children (its
    non-None fields, in order) against a list."""
    if isinstance(value, torch.Tensor):
        return every_axis(value)
    if _is_model_output(value):
        return [_tree_shapes(v, every_axis) for v in value.values()]
    if isinstance(value, Mapping):
        return {k: _tree_shapes(v, every_axis) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_tree_shapes(v, every_axis) for v in value)
    return None


def scalar_sequence(value: Any) -> bool:
    """A non-empty list or tuple of Python scalars: a constant of the graph, like an int."""
    return (
        isinstance(value, (tuple, list)) and bool(value) and all(isinstance(v, (bool, int, float, str)) for v in value)
    )


def _token_like(name: str) -> bool:
    """Inputs that hold data, never constants: a plain list there is an untokenized or unconverted batch."""
    return name.endswith(("_ids", "mask", "labels", "values", "features", "embeds"))


def validate_inputs(sample_inputs: Any, dynamic_shapes: Mapping[str, Any] | None) -> dict[str, Any]:
    """Check inputs and dynamic shapes before any tracing; return a shallow copy of the inputs."""
    if not isinstance(sample_inputs, Mapping) or isinstance(sample_inputs, torch.Tensor):
        raise InputError(
            f"sample_inputs must be a mapping of forward argument names to tensors (e.g. a tokenizer's "
            f"BatchEncoding), got {type(sample_inputs).__name__}"
        )
    if not sample_inputs:
        raise InputError("sample_inputs is empty: pass the forward kwargs of one real call, e.g. input_ids")
    inputs = dict(sample_inputs)
    for name, value in inputs.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise InputError(f"sample input name {name!r} is not a valid forward argument name")
        if isinstance(value, (tuple, list)) and value and all(isinstance(v, torch.Tensor) for v in value):
            continue  # e.g. an encoder-decoder's `encoder_outputs`: a tuple of tensors (a pytree)
        if scalar_sequence(value) and not _token_like(name):
            continue  # a constant such as the layer indices `output_hidden_states=[-2, -5]` (VipLlava)
        if isinstance(value, Mapping) and _tensor_tree(value):
            # `encoder_outputs` / `mm_encoder_outputs` as generate passes them: pytrees of tensors (ModelOutputs,
            # dicts of them).
            continue
        if not (isinstance(value, (torch.Tensor, bool, int, float, type(None))) or _is_cache(value)):
            raise InputError(
                f"sample input {name!r} is a {type(value).__name__}; export takes tensors, transformers "
                "Cache objects, or Python scalars/None (constants). Tokenize text with return_tensors='pt'."
            )
    if dynamic_shapes is not None:
        if not isinstance(dynamic_shapes, Mapping):
            raise InputError("dynamic_shapes must be a dict keyed by sample input name")
        unknown = sorted(set(dynamic_shapes) - set(inputs))
        if unknown:
            raise InputError(
                f"dynamic_shapes names {unknown}, which are not sample inputs; the sample inputs are {sorted(inputs)}"
            )
        for name, spec in dynamic_shapes.items():
            _validate_dim_spec(name, spec, inputs[name])
    return inputs


def _validate_dim_spec(name: str, spec: Any, value: Any) -> None:
    if spec is None or not isinstance(value, torch.Tensor):
        return
    if isinstance(spec, Mapping):
        dims = spec
    elif isinstance(spec, (list, tuple)):
        dims = dict(enumerate(spec))
    else:
        raise InputError(f"dynamic_shapes[{name!r}] must be a dict {{axis: Dim}} or a list per axis")
    for axis, dim in dims.items():
        if not isinstance(axis, int) or not -value.ndim <= axis < value.ndim:
            raise InputError(f"dynamic_shapes[{name!r}] names axis {axis!r}, but the input has {value.ndim} axes")
        low, high = getattr(dim, "min", None), getattr(dim, "max", None)
        if isinstance(low, int) and isinstance(high, int) and low > high:
            raise InputError(f"dynamic_shapes[{name!r}][{axis}]: Dim min {low} is greater than max {high}")


def auto_dynamic_shapes(inputs: Mapping[str, Any]) -> dict[str, Any]:
    """Mark every axis of every tensor and cache leaf `Dim.AUTO` (torch.export infers the relations)."""

    def every_axis(tensor: torch.Tensor) -> dict[int, Any]:
        return {axis: torch.export.Dim.AUTO for axis in range(tensor.ndim)}

    shapes: dict[str, Any] = {}
    for name, value in inputs.items():
        if isinstance(value, torch.Tensor):
            shapes[name] = every_axis(value)
        elif _is_cache(value):
            shapes[name] = cache_dynamic_shapes(value, every_axis)
        elif isinstance(value, (tuple, list, Mapping)):
            shapes[name] = _tree_shapes(value, every_axis)
        else:
            shapes[name] = None
    return shapes


def size_one_axis_warnings(inputs: Mapping[str, Any]) -> list[str]:
    """One warning per sample tensor with a size-1 axis, for a `dynamic=True` export: torch.export specialises a
    size-1 sample axis (0/1 specialisation) even under `Dim.AUTO`, so that axis is exported static.

    A 4-D `attention_mask` (transformers' `[batch, 1, query, key]` form, which `generate` builds for a static
    cache) is 1 on axis 1 by design: that axis broadcasts over the heads, and no sample should widen it."""
    warnings: list[str] = []
    for name, value in inputs.items():
        shape = getattr(value, "shape", ())
        ones = [axis for axis, size in enumerate(shape) if size == 1]
        if name == "attention_mask" and len(shape) == 4:
            ones = [axis for axis in ones if axis != 1]
        if ones:
            warnings.append(
                f"{name} has size 1 on axis {ones} in the sample: that axis is exported static; "
                "trace with a sample of size >= 2 there to keep it dynamic"
            )
    return warnings


def _asked_axes(spec: Any, ndim: int) -> list[int]:
    """The axes of one tensor that `dynamic_shapes` asks dynamic (`Dim.AUTO` for all of them, or per axis)."""
    from torch.export.dynamic_shapes import _DimHint, _DimHintType

    def dynamic(dim: Any) -> bool:
        static = isinstance(dim, _DimHint) and dim.type == _DimHintType.STATIC
        return dim is not None and not isinstance(dim, int) and not static

    if spec is torch.export.Dim.AUTO:
        return list(range(ndim))
    if isinstance(spec, Mapping) and all(isinstance(k, int) for k in spec):
        return [k % ndim for k, v in spec.items() if dynamic(v) and -ndim <= k < ndim]
    if isinstance(spec, (list, tuple)) and len(spec) == ndim:
        return [axis for axis, dim in enumerate(spec) if dynamic(dim)]
    return []


def specialised_axes(
    program: torch.export.ExportedProgram,
    inputs: Mapping[str, Any],
    dynamic_shapes: Mapping[str, Any] | None,
    images: Mapping[str, int] | None = None,
) -> dict[str, dict[str, int]]:
    """The tensor inputs' axes asked dynamic that the trace fixed at the sample's size: `{name: {axis: size}}`
    (the axis as a string, as the report's JSON keeps it). Only samples of size >= 2 count (a size-1 axis is
    torch's 0/1 specialisation, warned about before the trace); the image axes `images` are said apart."""
    from hfexport.frontends.multimodal import _static_size

    if dynamic_shapes is None:
        return {}
    placeholders = {n.name: n for n in program.graph.nodes if n.op == "placeholder"}
    user_inputs = set(program.graph_signature.user_inputs)
    fixed: dict[str, dict[str, int]] = {}
    for name, value in inputs.items():
        node = placeholders.get(name)
        if not isinstance(value, torch.Tensor) or node is None or name not in user_inputs:
            continue
        traced = node.meta.get("val")
        if not isinstance(traced, torch.Tensor) or traced.ndim != value.ndim:
            continue
        for axis in _asked_axes(dynamic_shapes.get(name), value.ndim):
            if value.shape[axis] < 2 or (axis == 0 and name in (images or {})):
                continue
            size = _static_size(traced.shape[axis])
            if size is not None:
                fixed.setdefault(name, {})[str(axis)] = size
    return fixed


def _flat_forward(forward: Any, names: list[str]) -> Any:
    """A forward whose explicit signature is the sample input names, in order.

    transformers forwards take **kwargs; torch.export would fold those into one argument that a
    per-input dynamic_shapes dict cannot address.
    """

    def forward_with_explicit_signature(*args: Any, **kwargs: Any) -> Any:
        kwargs.update(zip(names, args, strict=False))
        return forward(**kwargs)

    forward_with_explicit_signature.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names]
    )
    return forward_with_explicit_signature


def _prepare_model(model: torch.nn.Module, session: Any, warnings_out: list[str]) -> None:
    if model.training:
        warnings_out.append("the model was in training mode; it was exported in eval mode (dropout off)")
        for module in model.modules():
            session.setattr(module, "training", False)
    seen: set[int] = set()
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or id(config) in seen or not hasattr(config, "_attn_implementation_internal"):
            continue
        seen.add(id(config))
        impl = config._attn_implementation_internal
        if isinstance(impl, str) and _SWITCHED_ATTENTION.match(impl):
            warnings_out.append(f"attn_implementation {impl!r} is not exportable; traced with 'sdpa' instead")
            session.setattr(config, "_attn_implementation_internal", "sdpa")
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if not _STATEFUL_ATTRIBUTE.search(name) or isinstance(value, torch.nn.Module):
                continue
            # Tensors are cleared for the trace; every other value is re-set to itself so that whatever the
            # trace assigns (a FakeTensor, a SymInt) is replaced by the eager value afterwards.
            session.setattr(module, name, None if isinstance(value, (torch.Tensor, tuple)) else value)


def _upcast_bfloat16_weights(model: torch.nn.Module, session: Any) -> dict[int, torch.Tensor]:
    """Every bf16 parameter and buffer holds a float32 copy for the trace; the original comes back on exit.

    `.data` is swapped, not the attribute: the tensor objects (and weights tied between modules) stay the same.
    Returns the float32 copies by the id of the tensor that held them, for `_own_upcast_weights`.
    """
    upcast: dict[int, torch.Tensor] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.dtype != torch.bfloat16 or id(tensor) in upcast:
            continue
        original = tensor.data
        tensor.data = upcast[id(tensor)] = original.to(torch.float32)
        session.call_on_exit(lambda tensor=tensor, original=original: setattr(tensor, "data", original))
    return upcast


def _own_upcast_weights(program: torch.export.ExportedProgram, upcast: dict[int, torch.Tensor]) -> None:
    """The program's state dict and constants are the model's own tensor objects, whose bf16 data comes back when
    the session ends: give the program new tensors around the float32 copies it was traced with."""
    for table in (program.state_dict, program.constants):
        for name, value in list(table.items()):
            data = upcast.get(id(value))
            if data is None:
                continue
            if isinstance(value, torch.nn.Parameter):
                table[name] = torch.nn.Parameter(data, requires_grad=value.requires_grad)
            else:
                table[name] = data


def _upcast_bfloat16_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    """The inputs with float32 copies of their bf16 tensors (in pytrees and caches too); the caller's stay."""

    def upcast(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16:
            return value.to(torch.float32)
        return value

    upcast_inputs: dict[str, Any] = {}
    for name, value in inputs.items():
        if _is_cache(value):
            leaves, skeleton = flatten_cache(value)
            if any(isinstance(leaf, torch.Tensor) and leaf.dtype == torch.bfloat16 for leaf in leaves):
                value = unflatten_cache([upcast(leaf) for leaf in leaves], skeleton)
            upcast_inputs[name] = value
        else:
            upcast_inputs[name] = torch.utils._pytree.tree_map(upcast, value)
    return upcast_inputs


def check_attention_implementation(model: torch.nn.Module) -> None:
    """Refuse, before tracing, an attention implementation that cannot be traced or switched."""
    for module in model.modules():
        config = getattr(module, "config", None)
        impl = getattr(config, "_attn_implementation_internal", None)
        if isinstance(impl, str) and impl not in _EXPORTABLE_ATTENTION and not _SWITCHED_ATTENTION.match(impl):
            raise InputError(
                f"{type(module).__name__} uses attn_implementation={impl!r}, which cannot be exported; "
                "load the model with attn_implementation='sdpa' (or 'eager') or call "
                "model.set_attn_implementation('sdpa') first"
            )


def capture(
    model: torch.nn.Module,
    sample_inputs: Mapping[str, Any],
    options: CaptureOptions,
    context: RewriteContext,
    warnings_out: list[str] | None = None,
) -> torch.export.ExportedProgram:
    """Export `model` on `sample_inputs` with the `patch` and `fx` stages applied."""
    warnings_out = warnings_out if warnings_out is not None else []
    inputs = validate_inputs(sample_inputs, options.dynamic_shapes)
    check_attention_implementation(model)
    register_cache_pytrees(*(type(v) for v in inputs.values() if _is_cache(v)))

    if options.dynamic_shapes is not None:
        dynamic_shapes: dict[str, Any] | None = dict(options.dynamic_shapes)
    elif options.dynamic:
        dynamic_shapes = auto_dynamic_shapes(inputs)
        warnings_out.extend(size_one_axis_warnings(inputs))
    else:
        dynamic_shapes = None

    # A pixel-input forward's image layout (grid_thw, image_sizes...) is baked in: the vision tower splits its
    # patches with Python ints from it, which torch.export can only trace as data-dependent values.
    # A vision tower exported alone gets the same treatment (its `grid_thw` splits the patches likewise).
    layout = pixel_layouts(inputs, vision_tower=is_vision_tower(model))
    if layout and options.dynamic_shapes is None and dynamic_shapes is not None:
        dynamic_shapes.update(dict.fromkeys(layout))  # static: the graph holds for these values only

    model_name = type(model).__name__
    # The patch rules see the model as a layout-specialised one (`patch/fake-constant-layouts` applies then);
    # the trace is still of `model` itself, so its weights keep their names.
    patched_model = LayoutSpecialised(model, layout) if layout else model
    with engine.patched(patched_model, context, model_name=model_name) as session:
        if options.strict and session.gated_rule_ids:
            # TorchDynamo cannot trace the ContextVar that keeps these patches invisible to other threads.
            raise InputError(
                f"strict=True cannot trace the module-function patches {session.gated_rule_ids} that this model "
                "needs; export with strict=False (the default), or disable those rules with "
                "RuleSelection(disable=...) if the model exports without them"
            )
        _prepare_model(model, session, warnings_out)
        # Resolving the patch rules' targets imported their modeling modules: their own cache classes become
        # pytree nodes now, with the first export, not with the next one (docs/reliability.md, "What stays").
        register_cache_pytrees()
        upcast = _upcast_bfloat16_weights(model, session) if options.upcast_bfloat16 else {}
        if options.upcast_bfloat16:
            inputs = _upcast_bfloat16_inputs(inputs)
        # After the patches, so a patch of the top-level forward sits under the explicit signature.
        forward = bake_layout(model.forward, layout, model_name) if layout else model.forward
        session.setattr(model, "forward", _flat_forward(forward, list(inputs)))
        # Inference export: under no_grad, modules that toggle grad mode internally (e.g. rotary
        # embeddings decorated with @torch.no_grad) leave no set_grad_enabled wrappers in the graph.
        with context.stage("trace", model=model_name), session.active(), torch.no_grad():
            program = torch.export.export(
                model,
                (),
                inputs,
                dynamic_shapes=dynamic_shapes,
                strict=options.strict,
                prefer_deferred_runtime_asserts_over_guards=options.prefer_deferred_runtime_asserts_over_guards,
            )
        _own_upcast_weights(program, upcast)
    if layout:
        program.graph_module.meta[LAYOUT_META] = {name: values for name, (values, _) in layout.items()}
    # The image count joins the layout where the forward makes it Python structure (a per-image list of features,
    # one output per image): torch.export keeps that axis at the sample's size, so another count is refused.
    # With a layout input the layout already fixes the images (and a flattened patch axis is no image count).
    # Only beside text: without it (an image classifier, a vision tower) the pixels' axis 0 is the model's batch,
    # and a batch the trace fixes stays a failure to fix, not a layout.
    text = any(isinstance(inputs.get(k), torch.Tensor) for k in ("input_ids", "inputs_embeds"))
    derived = options.dynamic_shapes is None or options.derived_shapes
    auto = dynamic_shapes if derived and not layout and text else None
    images = specialised_image_axes(program, inputs, auto)
    fixed = specialised_axes(program, inputs, dynamic_shapes if derived else None, images)
    if fixed:
        program.graph_module.meta[STATIC_AXES_META] = fixed
        for name, axes in fixed.items():
            listed = ", ".join(f"{axis} at {size}" for axis, size in axes.items())
            warnings_out.append(
                f"{name}: axis {listed} exported static, the sample's size, though asked dynamic: the model's code "
                "fixed it during the trace (a Python loop over it, a branch on it; `hfexport scan` finds such "
                "code); another size is refused"
            )
    if images:
        program.graph_module.meta[IMAGE_COUNT_META] = images
        for name, count in images.items():
            warnings_out.append(
                f"{name}: the image axis (0) is exported static at the sample's {count}: the model makes one Python "
                "value per image or row of images (a per-image list of features); another image count is refused"
            )
    engine.apply("fx", program, context)
    return program
