"""Lower a captured `ExportedProgram` to ExecuTorch: `executorch.exir.ExecutorchProgramManager`.

Order: stage `executorch` (fixes on the ATen program) -> `to_edge_transform_and_lower(partitioner)` (XNNPACK
or CUDA delegation; stage time "edge") -> `to_executorch(ExecutorchBackendConfig)` (memory planning from the
`alloc_*` flags; stage time "to_executorch").

Bounds: ExecuTorch plans every tensor at its upper-bound size. A dynamic axis without an upper bound is
planned at its size in the sample (executorch `eval_upper_bound` falls back to the trace hint), so a longer
input fails at run time. `bounded_dynamic_shapes` gives every unbounded axis a cap before the trace: the
batch axis `MAX_BATCH`, an image's height and width the config's `image_size` (else the sample's), a raw
waveform's samples `MAX_AUDIO_SAMPLES`, every other axis the model's `max_position_embeddings` (or the static
cache length). Explicit bounds (`Dim("seq", max=...)`) are kept.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

import torch

from hfexport.configs import ExecutorchConfig
from hfexport.rewrites import engine
from hfexport.rewrites.engine import RewriteContext

logger = logging.getLogger("hfexport")

# Batch cap for an unbounded batch axis (axis 0). Memory is planned for the cap, so it stays small:
# on-device programs run one or a few sequences; pass `Dim("batch", max=...)` for more.
MAX_BATCH = 8
# Sequence cap when the model config names no maximum length (no max_position_embeddings or alias).
FALLBACK_MAX_SEQUENCE = 2048
# Config attributes that hold the longest sequence a model supports, by the names architectures use.
_MAX_LENGTH_ATTRIBUTES = ("max_position_embeddings", "n_positions", "max_sequence_length", "n_ctx", "seq_length")
# Cap of a raw-audio axis (`input_values`: waveform samples), which no config names: 10 s at 16 kHz, the rate
# of the speech models' feature extractors. Planned memory grows with it (see docs/executorch.md, Bounds).
MAX_AUDIO_SAMPLES = 160_000


def check_backend(config: ExecutorchConfig) -> None:
    """Refuse, before tracing, a backend this machine cannot lower to."""
    if config.backend != "cuda":
        return
    if not torch.cuda.is_available():
        raise RuntimeError(
            "ExecutorchConfig(backend='cuda') needs a CUDA device, but torch.cuda.is_available() is False "
            f"(torch {torch.__version__}); export with backend='xnnpack' on a CPU-only machine"
        )
    try:
        from executorch.backends.cuda.cuda_partitioner import CudaPartitioner  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(
            f"ExecutorchConfig(backend='cuda') needs executorch's CUDA backend, which does not import: {exc}"
        ) from exc


def _partitioners(config: ExecutorchConfig) -> list[Any]:
    if config.backend == "cuda":
        # ExecuTorch's CUDA backend compiles the delegated graph with AOTInductor and moves the program to the
        # device itself; the captured program (and the caller's model) stay on the CPU.
        from executorch.backends.cuda.cuda_backend import CudaBackend
        from executorch.backends.cuda.cuda_partitioner import CudaPartitioner

        return [CudaPartitioner([CudaBackend.generate_method_name_compile_spec("forward")])]
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner

    return [XnnpackPartitioner()]


def backend_config(config: ExecutorchConfig) -> Any:
    """The `ExecutorchBackendConfig` for `config`: memory planning from the `alloc_*` flags."""
    from executorch.exir import ExecutorchBackendConfig
    from executorch.exir.passes import MemoryPlanningPass

    planning = MemoryPlanningPass(
        alloc_graph_input=config.alloc_graph_input,
        alloc_graph_output=config.alloc_graph_output,
        alloc_mutable_buffers=config.alloc_mutable_buffers,
    )
    # A mutable buffer left out of the plan is bound by name at run time, so its name must be in the program.
    return ExecutorchBackendConfig(
        memory_planning_pass=planning,
        emit_mutable_buffer_names=not config.alloc_mutable_buffers,
    )


# -- bounds ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DimCaps:
    """The caps given to unbounded dynamic axes: `batch` for axis 0, `image` (height, width) for the last two
    axes of an image input, `audio` for the samples axis of a raw-audio input, `sequence` for the others."""

    batch: int
    sequence: int
    sequence_source: str
    image: tuple[int, int] | None = None  # None: an image axis is capped at the sample's size
    image_source: str = "the sample's size: the model config names no image_size"
    audio: int = MAX_AUDIO_SAMPLES


def _is_cache(value: Any) -> bool:
    from hfexport.frontends.torch_export import _is_cache as is_cache

    return is_cache(value)


def _configs(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """The model's config and its sub-configs (text config first, then e.g. `vision_config`), by path."""
    config = getattr(model, "config", None)
    if config is None:
        return []
    found = [("config", config)]
    if hasattr(config, "get_text_config"):
        found.insert(0, ("config", config.get_text_config(decoder=True)))
    sub = getattr(config, "sub_configs", None) or {}
    found += [(f"config.{key}", getattr(config, key, None)) for key in sub]
    return [(path, cfg) for path, cfg in found if cfg is not None]


def _image_size(value: Any) -> tuple[int, int] | None:
    """(height, width) from a config's `image_size`: an int or a pair."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value, value
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value):
        return int(value[0]), int(value[1])
    return None


def dim_caps(model: torch.nn.Module, sample_inputs: Mapping[str, Any]) -> DimCaps:
    """The caps for `model`. Sequence axes: the static cache length when an input is a `StaticCache`, else the
    config's maximum length (`max_position_embeddings` or an alias), else `FALLBACK_MAX_SEQUENCE`. Image axes:
    the config's (or a sub-config's) `image_size`, else the sample's size. Raw audio: `MAX_AUDIO_SAMPLES`."""
    configs = _configs(model)
    image, image_source = None, DimCaps.image_source
    for path, cfg in configs:
        size = _image_size(getattr(cfg, "image_size", None))
        if size is not None:
            image, image_source = size, f"{path}.image_size"
            break
    images = {"image": image, "image_source": image_source, "audio": MAX_AUDIO_SAMPLES}
    for name, value in sample_inputs.items():
        # A fixed-size cache (StaticCache) reports its length; a growing one (DynamicCache) reports -1.
        length = value.get_max_length() if _is_cache(value) and hasattr(value, "get_max_length") else None
        if isinstance(length, int) and length > 0:
            return DimCaps(MAX_BATCH, length, f"the static cache length of {name!r}", **images)
    for path, cfg in configs:
        for attr in _MAX_LENGTH_ATTRIBUTES:
            value = getattr(cfg, attr, None)
            if isinstance(value, int) and value > 0:
                return DimCaps(MAX_BATCH, value, f"{path}.{attr}", **images)
    return DimCaps(
        MAX_BATCH, FALLBACK_MAX_SEQUENCE, "the default cap: the model config names no maximum length", **images
    )


def axis_kinds(name: str, value: Any) -> dict[int, str]:
    """The kind of each non-batch axis of one input that is not a sequence: "channels", "height" and "width" for
    the last three axes of a floating tensor of rank >= 4 (images, `(batch, channels, height, width)`, videos),
    "audio" for axis 1 of a raw waveform (`input_values`, `(batch, samples)`)."""
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return {}
    if value.dim() >= 4:
        return {value.dim() - 3: "channels", value.dim() - 2: "height", value.dim() - 1: "width"}
    if value.dim() == 2 and name.endswith("input_values"):
        return {1: "audio"}
    return {}


def _waveform_mask_kinds(name: str, value: Any, inputs: Mapping[str, Any]) -> dict[int, str]:
    """{1: "audio"} for the `attention_mask` of a raw waveform (`(batch, samples)`, as long as `input_values`):
    it runs as long as the waveform, so it takes the audio cap, not the text one (moonshine's mask was planned for
    its 1279-sample sample while the waveform took 160 000)."""
    waveform = inputs.get("input_values")
    if not name.endswith("attention_mask") or not isinstance(value, torch.Tensor) or value.dim() != 2:
        return {}
    if axis_kinds("input_values", waveform) != {1: "audio"} or waveform.shape[1] != value.shape[1]:
        return {}
    return {1: "audio"}


def _unbounded_max(value: Any) -> bool:
    return value is None or not isinstance(value, int) or value >= 2**62


def _cap_dim(dim: Any, cap: int, named: dict[str, Any]) -> tuple[Any, bool]:
    """`dim` with an upper bound `cap` if it has none; return (dim, whether it was capped)."""
    from torch.export.dynamic_shapes import _DerivedDim, _DimHint, _DimHintType

    if isinstance(dim, _DimHint):
        if dim.type == _DimHintType.STATIC or not _unbounded_max(dim.max):
            return dim, False
        return _DimHint(dim.type, min=dim.min, max=cap, _factory=False), True
    if isinstance(dim, torch.export.Dim) and not isinstance(dim, _DerivedDim) and _unbounded_max(dim.max):
        # One new Dim per name, so inputs that share a named axis still share it.
        if dim.__name__ not in named:
            low = dim.min if isinstance(dim.min, int) and dim.min > 0 else None
            named[dim.__name__] = torch.export.Dim(dim.__name__, min=low, max=cap)
        return named[dim.__name__], True
    # None, ints, bounded Dims, derived Dims (`2 * seq`: their root carries the bound).
    return dim, False


def _cap_axes(
    spec: Any,
    shape: tuple[int, ...] | None,
    kinds: dict[int, str],
    caps: DimCaps,
    named: dict[str, Any],
    out: list[str],
    value: Any = None,
) -> Any:
    """Cap the axes of one tensor's spec (dict {axis: dim} or list per axis); recurse into containers, with the
    sample's subtree `value`, so that a nested tensor's axis is never capped below its sample size (a VLM's
    per-image features `mm_encoder_outputs.image.pooler_output.0` of 16 rows were planned for 8, the batch cap)."""

    def cap_for(axis: int) -> int:
        if shape is not None and axis < 0:
            axis += len(shape)
        sample = shape[axis] if shape is not None and 0 <= axis < len(shape) else 0
        kind = kinds.get(axis)
        if axis == 0:
            cap = caps.batch
        elif kind in ("height", "width"):
            # An image fits the model's image_size; without one, the program takes the sample's size.
            cap = caps.image[0 if kind == "height" else 1] if caps.image is not None else sample
        elif kind == "audio":
            cap = caps.audio
        elif kind == "channels":
            cap = sample  # fixed by the first convolution's weight
        else:
            cap = caps.sequence
        # Never below the sample: the program must at least run on what it was traced with.
        return max(cap, sample)

    def note(axis: int) -> str:
        kind = kinds.get(axis + len(shape) if shape is not None and axis < 0 else axis)
        return f"axis {axis} ({kind}) <= {cap_for(axis)}" if kind else f"axis {axis} <= {cap_for(axis)}"

    if isinstance(spec, Mapping) and all(isinstance(k, int) for k in spec):
        result = {}
        for axis, dim in spec.items():
            result[axis], capped = _cap_dim(dim, cap_for(axis), named)
            if capped:
                out.append(note(axis))
        return result
    if isinstance(spec, (list, tuple)) and all(not isinstance(d, (list, tuple, Mapping)) for d in spec):
        dims = []
        for axis, dim in enumerate(spec):
            new, capped = _cap_dim(dim, cap_for(axis), named)
            dims.append(new)
            if capped:
                out.append(note(axis))
        return type(spec)(dims)
    if isinstance(spec, Mapping):
        return {
            k: _cap_axes(v, _shape(_part(value, k)), {}, caps, named, out, _part(value, k)) for k, v in spec.items()
        }
    if isinstance(spec, (list, tuple)):
        parts = [_part(value, i) for i in range(len(spec))]
        return type(spec)(_cap_axes(v, _shape(p), {}, caps, named, out, p) for v, p in zip(spec, parts, strict=True))
    return spec


def _part(value: Any, key: Any) -> Any:
    """The sample's leaf or subtree at `key` of a container spec (a dict, ModelOutput, tuple or list), or None."""
    if isinstance(value, Mapping):
        if key in value:
            return value[key]
        fields = list(value.values())  # a ModelOutput's spec is the list of its fields (`auto_dynamic_shapes`)
        return fields[key] if isinstance(key, int) and key < len(fields) else None
    if isinstance(value, (list, tuple)) and isinstance(key, int) and key < len(value):
        return value[key]
    return None


def _shape(value: Any) -> tuple[int, ...] | None:
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def bounded_dynamic_shapes(
    model: torch.nn.Module,
    sample_inputs: Mapping[str, Any],
    config: ExecutorchConfig,
    warnings_out: list[str] | None = None,
) -> dict[str, Any] | None:
    """The `dynamic_shapes` to capture `model` with for ExecuTorch: every axis bounded.

    From `config.dynamic_shapes` when given, else every axis `Dim.AUTO` when `config.dynamic`, else None
    (a static export). Each unbounded axis (`Dim.AUTO`, `Dim.DYNAMIC`, `Dim("x")` without `max`) gets a cap
    (`dim_caps`); explicit bounds are kept. One warning (appended to `warnings_out`, else logged) lists the
    caps and how to pass explicit `Dim(min, max)` bounds instead.
    """
    from hfexport.frontends.torch_export import auto_dynamic_shapes, size_one_axis_warnings

    if config.dynamic_shapes is not None:
        shapes = dict(config.dynamic_shapes)
    elif config.dynamic:
        shapes = auto_dynamic_shapes(sample_inputs)
        if warnings_out is not None:
            # As the capture says for dynamic=True: torch.export specialises a size-1 sample axis.
            warnings_out.extend(size_one_axis_warnings(sample_inputs))
    else:
        return None
    caps = dim_caps(model, sample_inputs)
    named: dict[str, Any] = {}
    capped: list[str] = []
    bounded: dict[str, Any] = {}
    for name, spec in shapes.items():
        value = sample_inputs.get(name)
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else None
        axes: list[str] = []
        kinds = axis_kinds(name, value) or _waveform_mask_kinds(name, value, sample_inputs)
        bounded[name] = _cap_axes(spec, shape, kinds, caps, named, axes, value)
        capped += [f"{name} {a}" for a in dict.fromkeys(axes)]
    if capped:
        listed = " ".join(capped)
        special = ""
        if "(height)" in listed or "(width)" in listed:
            special += f", image height and width at {caps.image or 'the sample size'} ({caps.image_source})"
        if "(audio)" in listed:
            special += f", raw audio at {caps.audio} samples (hfexport.lowerings.executorch.MAX_AUDIO_SAMPLES)"
        message = (
            "ExecuTorch plans memory for the largest shape an input may take, so unbounded dynamic axes were "
            f"capped: batch axes at {caps.batch} (hfexport.lowerings.executorch.MAX_BATCH){special}, the others "
            f"at {caps.sequence} ({caps.sequence_source}): {', '.join(capped)}. For other bounds pass them "
            "explicitly, e.g. ExecutorchConfig(dynamic_shapes={'input_ids': {0: Dim('batch', min=1, max=4), "
            "1: Dim('seq', min=1, max=1024)}, 'attention_mask': {0: Dim('batch', min=1, max=4), "
            "1: Dim('seq', min=1, max=1024)}})"
        )
        if warnings_out is not None:
            warnings_out.append(message)
        else:
            logger.warning("%s", message)
    return bounded


def capture_options(
    model: torch.nn.Module,
    sample_inputs: Mapping[str, Any],
    config: ExecutorchConfig,
    warnings_out: list[str] | None = None,
) -> Any:
    """The `CaptureOptions` of an ExecuTorch export: `config`'s, with `bounded_dynamic_shapes` as the shapes.

    For `ExecutorchExporter` to override the capture options with (see docs/executorch.md).
    """
    from hfexport.frontends.torch_export import CaptureOptions

    return CaptureOptions(
        dynamic=config.dynamic,
        dynamic_shapes=bounded_dynamic_shapes(model, sample_inputs, config, warnings_out),
        strict=config.strict,
        prefer_deferred_runtime_asserts_over_guards=config.prefer_deferred_runtime_asserts_over_guards,
        derived_shapes=config.dynamic_shapes is None,
    )


def unbounded_inputs(program: torch.export.ExportedProgram) -> list[str]:
    """User inputs of `program` with an axis that has no upper bound, as "name axis i"."""
    from torch.export.graph_signature import InputKind
    from torch.utils._sympy.numbers import int_oo

    user = {s.arg.name for s in program.graph_signature.input_specs if s.kind == InputKind.USER_INPUT}
    found = []
    for node in program.graph.nodes:
        value = node.meta.get("val") if node.op == "placeholder" and node.name in user else None
        if not isinstance(value, torch.Tensor):
            continue
        for axis, size in enumerate(value.shape):
            if isinstance(size, torch.SymInt):
                upper = program.range_constraints.get(size.node.expr)
                if upper is None or upper.upper is int_oo:
                    found.append(f"{node.name} axis {axis}")
    return found


# -- lowering -------------------------------------------------------------------------------------------


def lower(program: torch.export.ExportedProgram, config: ExecutorchConfig, context: RewriteContext) -> Any:
    """Lower `program` to an `ExecutorchProgramManager` with the `executorch` stage applied."""
    from executorch.exir import EdgeCompileConfig, to_edge_transform_and_lower

    from hfexport.rewrites.kinds.executorch import edge_compile_config, edge_transform_passes

    rules = engine.apply("executorch", program, context)

    unbounded = unbounded_inputs(program)
    if unbounded:
        logger.warning(
            "ExecuTorch plans these dynamic axes at their sample size, since they have no upper bound: %s. "
            "Capture with bounded dims, e.g. ExecutorchConfig(dynamic_shapes=bounded_dynamic_shapes(model, "
            "inputs, config)) from hfexport.lowerings.executorch, or Dim(name, min, max) per axis",
            ", ".join(unbounded),
        )

    compile_config = None
    if config.backend == "cuda":
        # As executorch's CUDA examples do: the AOTInductor delegate takes ATen ops beyond the edge dialect.
        compile_config = EdgeCompileConfig(_check_ir_validity=False, _skip_dim_order=True)
    # Plus the targets the stage's verifier-exception rules found (executorch/sym-size-functions-verifier).
    compile_config = edge_compile_config(rules.outputs, compile_config)
    # Plus the edge passes the stage's edge-pass rules asked for (executorch/cache-input-no-write-back).
    passes = edge_transform_passes(rules.outputs)
    with context.stage("edge"):
        edge = to_edge_transform_and_lower(
            program, transform_passes=passes or None, partitioner=_partitioners(config), compile_config=compile_config
        )
    with context.stage("to_executorch"):
        return edge.to_executorch(backend_config(config))


# -- one program for several components ---------------------------------------------------------------


def one_program(managers: Mapping[str, Any], configs: Mapping[str, Any]) -> Any | None:
    """One `ExecutorchProgramManager` whose methods are the programs of `managers` (each lowered on its own, one
    `forward` each), named by their keys, or None when they cannot share one program.

    Nothing is lowered again: the lowered programs are emitted once more into one program, which stores each
    weight once. The emitter keeps one constant buffer per distinct tensor (by the sha256 of its bytes) and one
    copy of each delegate payload for all methods, and XNNPACK keeps its weights in the named data, keyed by the
    sha256 of their bytes, which one store for all methods holds once (as `to_edge_transform_and_lower` with a
    dict of programs does: its `EdgeProgramManager` keeps one store). None for a manager with another method
    than `forward` or with constant methods, for a delegate other than XNNPACK's (the CUDA backend keys its blobs
    by the method it was lowered for, `forward` in each), for named data that two programs hold under one key with
    different bytes, or for programs that disagree on whether their mutable buffers are named
    (`ExecutorchConfig.alloc_mutable_buffers`).
    """
    from executorch.exir import ExecutorchProgramManager
    from executorch.exir._serialize._named_data_store import NamedDataStore
    from executorch.exir.program._program import collect_named_data_store_from_exported_program

    if any(manager.methods != {"forward"} or manager.config_methods for manager in managers.values()):
        return None
    plans = [plan for manager in managers.values() for plan in manager.executorch_program.execution_plan]
    if not {delegate.id for plan in plans for delegate in plan.delegates} <= {"XnnpackBackend"}:
        return None
    given = [config for config in configs.values() if isinstance(config, ExecutorchConfig)]
    # Whether the emitter named the mutable buffers (they are then bound by name, not planned): read from each
    # emitted program, so a save without configs writes what the lowering wrote.
    named = {_names_mutable_buffers(manager.executorch_program.execution_plan) for manager in managers.values()}
    if len(named) != 1:
        return None
    settings = dataclasses.replace(
        backend_config(given[0] if given else ExecutorchConfig()), emit_mutable_buffer_names=named.pop()
    )
    store = NamedDataStore()
    programs = {name: manager.exported_program("forward") for name, manager in managers.items()}
    try:
        for program in programs.values():
            collect_named_data_store_from_exported_program(program, store)
    except ValueError:  # one key, other bytes: not data the programs can share
        return None
    return ExecutorchProgramManager(programs, None, settings, store.get_named_data_store_output())


def _names_mutable_buffers(plans: list[Any]) -> bool:
    """Whether an emitted program's plans name a tensor (a mutable buffer left out of the memory plan)."""
    for plan in plans:
        for value in plan.values:
            info = getattr(value.val, "extra_tensor_info", None)
            if info is not None and info.fully_qualified_name:
                return True
    return False
