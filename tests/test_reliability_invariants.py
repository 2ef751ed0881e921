"""Issue #8, items 2-3: an export leaves the caller's model, inputs and process exactly as they were.

After every exporter (and `export_for_generation`): parameters and buffers bit-identical (same objects, dtype,
device), config, attention implementation, training flags, hooks, instance attributes and forward signature
unchanged, eager outputs unchanged; the caller's `sample_inputs` dict and tensors unchanged; no new or replaced
attribute on `torch.Tensor`, `torch.nn.Module`, `torch`, `torch.nn.functional`, the model's classes or its
modeling module; no patch target replaced, no gate installed, no torch-function mode left on the stack; no pytree
node registered but transformers Cache and ModelOutput classes (what stays on purpose: the tests at the end).

The snapshot helpers here are shared by tests/test_reliability_faults.py, test_reliability_concurrency.py and
test_reliability_bad_inputs.py.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import transformers

from hfexport import AutoExportConfig, AutoHfExporter
from hfexport.rewrites.engine import default_registry
from hfexport.rewrites.kinds.patch import MethodPatch, ModuleFunctionPatch, installed_gates, resolve

BACKENDS = ["dynamo", "onnx", "openvino", "executorch"]
_PACKAGE = {"onnx": "onnxruntime", "executorch": "executorch", "openvino": "openvino"}
# Relative to max|eager|: ONNX Runtime's fused kernels and OpenVINO's CPU kernels reorder float sums.
RTOL = {"dynamo": 1e-5, "onnx": 1e-4, "openvino": 1e-4, "executorch": 1e-4}


# -- micro models: one layer, so a whole export takes seconds ---------------------------------------------------
_LLAMA = dict(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=1,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)


def micro_llama(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_LLAMA)).eval()


def micro_moe(seed: int = 0) -> torch.nn.Module:
    """A Qwen3-MoE: its experts make the backends' batched-expert method patches install, so there is something to
    restore (and ONNX translate transformers' grouped_mm op)."""
    config = transformers.Qwen3MoeConfig(**_LLAMA, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2)
    config.head_dim = 8
    torch.manual_seed(seed)
    return transformers.Qwen3MoeForCausalLM(config).eval()


def sample_inputs(seed: int = 0, batch: int = 2, length: int = 5) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 64, (batch, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def skip_without(backend: str) -> None:
    if backend in _PACKAGE:
        pytest.importorskip(_PACKAGE[backend])


def config_for(backend: str, **fields: Any) -> Any:
    return AutoExportConfig.from_dict({"export_format": backend, **fields})


def export(model: torch.nn.Module, inputs: Mapping[str, Any], backend: str, **fields: Any) -> tuple[Any, Any]:
    """(native program, exporter) of one export."""
    config = config_for(backend, **fields)
    exporter = AutoHfExporter.from_config(config)
    return exporter.export(model, inputs, config=config), exporter


def eager_logits(model: torch.nn.Module, inputs: Mapping[str, Any]) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).logits


def run_logits(program: Any, backend: str, inputs: Mapping[str, Any]) -> torch.Tensor:
    """The first output (logits) of `program` run in its own runtime."""
    if backend == "dynamo":
        with torch.no_grad():
            return program.module()(**inputs)["logits"]
    if backend == "onnx":
        import onnx_ir as ir
        import onnxruntime as ort

        from hfexport.naming import onnx_feed

        session = ort.InferenceSession(
            ir.to_proto(program.model).SerializeToString(), providers=["CPUExecutionProvider"]
        )
        names = [i.name for i in session.get_inputs()]
        return torch.from_numpy(session.run(None, onnx_feed(names, inputs))[0])
    if backend == "openvino":
        import openvino as ov

        from hfexport.naming import openvino_feed
        from hfexport.runtime.openvino import output_tensor

        compiled = ov.Core().compile_model(program, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
        result = compiled(openvino_feed(inputs, compiled))
        return output_tensor(result[0], compiled.outputs[0].get_element_type())
    from hfexport.runtime.executorch import run_program

    return run_program(program, inputs)[0]


def assert_close_to(got: torch.Tensor, expected: torch.Tensor, backend: str) -> None:
    assert got.shape == expected.shape, (got.shape, expected.shape)
    bound = RTOL[backend] * expected.abs().max().item() + 1e-6
    assert (got.float() - expected.float()).abs().max().item() <= bound


# -- snapshots --------------------------------------------------------------------------------------------------
_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_pre_hooks",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


@dataclass
class ModelState:
    tensors: dict[str, tuple[int, torch.Tensor]]
    config: Any
    attention: list[Any]
    training: list[bool]
    hooks: list[Any]
    instance_attributes: list[dict[str, Any]]
    signature: inspect.Signature
    global_hooks: list[Any]


def model_state(model: torch.nn.Module) -> ModelState:
    tensors = {}
    for name, value in [*model.named_parameters(), *model.named_buffers()]:
        # The object itself (no parameter was swapped) and a copy of its bits, dtype and device.
        tensors[name] = (id(value), value.detach().clone())
    configs = [
        m.config for m in model.modules() if isinstance(getattr(m, "config", None), transformers.PretrainedConfig)
    ]
    return ModelState(
        tensors=tensors,
        config=(id(model.config), model.config.to_json_string(use_diff=False)),
        attention=[(id(c), c._attn_implementation_internal) for c in configs],
        training=[m.training for m in model.modules()],
        hooks=[{k: list(getattr(m, k).items()) for k in _HOOK_DICTS} for m in model.modules()],
        # Every instance attribute, by identity: a patch bound on an instance, a cached tensor replaced by a
        # FakeTensor, a forward override, each shows up here.
        instance_attributes=[{k: _fingerprint(v) for k, v in vars(m).items()} for m in model.modules()],
        signature=inspect.signature(model.forward),
        global_hooks=[
            list(getattr(torch.nn.modules.module, name).items())
            for name in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks")
        ],
    )


def _fingerprint(value: Any) -> Any:
    """Plain data by value, everything else by identity. torch.export's non-strict tracer restores the plain
    container attributes it watched (`_tp_plan`, ...) as equal copies, which is no change to the model."""
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_fingerprint(v) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _fingerprint(v)) for k, v in value.items()))
    if isinstance(value, (set, frozenset)):
        return (type(value).__name__, frozenset(_fingerprint(v) for v in value))
    return ("object", id(value))


def assert_model_untouched(model: torch.nn.Module, before: ModelState) -> None:
    after = model_state(model)
    assert after.tensors.keys() == before.tensors.keys()
    for name, (ident, value) in before.tensors.items():
        now_id, now = after.tensors[name]
        assert now_id == ident, f"{name} is another tensor object"
        assert now.dtype == value.dtype and now.device == value.device, f"{name} changed dtype/device"
        # A meta tensor has a shape and no values to compare.
        assert value.device.type == "meta" or torch.equal(now, value), f"{name} changed value"
    assert after.config == before.config, "model.config changed"
    assert after.attention == before.attention, "attn_implementation changed"
    assert after.training == before.training, "a training flag changed"
    assert after.hooks == before.hooks, "hooks changed"
    assert after.global_hooks == before.global_hooks, "global module hooks changed"
    assert after.instance_attributes == before.instance_attributes, _attribute_diff(before, after)
    assert after.signature == before.signature, "forward signature changed"


def _attribute_diff(before: ModelState, after: ModelState) -> str:
    for i, (old, new) in enumerate(zip(before.instance_attributes, after.instance_attributes, strict=True)):
        if old != new:
            changed = sorted(k for k in old.keys() | new.keys() if old.get(k) != new.get(k))
            return f"module #{i}: instance attributes {changed} added, removed or replaced"
    return "instance attributes changed"


@dataclass
class InputState:
    keys: list[str]
    values: dict[str, tuple[int, Any]]


def input_state(inputs: Mapping[str, Any]) -> InputState:
    return InputState(
        keys=list(inputs),
        values={k: (id(v), v.clone() if isinstance(v, torch.Tensor) else v) for k, v in inputs.items()},
    )


def assert_inputs_untouched(inputs: Mapping[str, Any], before: InputState) -> None:
    assert list(inputs) == before.keys, "sample_inputs keys changed"
    for name, (ident, value) in before.values.items():
        assert id(inputs[name]) == ident, f"sample_inputs[{name!r}] was replaced"
        if isinstance(value, torch.Tensor):
            now = inputs[name]
            assert now.dtype == value.dtype and now.shape == value.shape and torch.equal(now, value), name


def _namespace(obj: Any) -> dict[str, int]:
    return {k: id(v) for k, v in vars(obj).items()}


def _patch_targets() -> dict[str, int]:
    """Identity of every object a patch rule could replace: module functions and class methods."""
    targets: dict[str, int] = {}
    for rule in default_registry().rules("patch"):
        paths: tuple[str, ...] = ()
        if isinstance(rule, ModuleFunctionPatch):
            paths = (rule.target,) if isinstance(rule.target, str) else tuple(rule.target)
        elif isinstance(rule, MethodPatch) and isinstance(rule.target, str):
            paths = (rule.target,)
        for path in paths:
            resolved = resolve(path)
            if not isinstance(resolved, str):
                owner, name = resolved
                targets[path] = id(vars(owner).get(name, getattr(owner, name)))
    return targets


@dataclass
class ProcessState:
    namespaces: dict[str, dict[str, int]]
    targets: dict[str, int]
    grad_enabled: bool
    pytree_nodes: set[type]


def lasting_pytree_node(cls: type) -> bool:
    """The pytree nodes an export may add for the process lifetime (docs/reliability.md, "What stays"): transformers
    Cache classes (hfexport registers them, so that a program with cache inputs can be called and saved), and the
    ModelOutput classes of the modeling modules that resolving a patch rule's target imports (transformers
    registers a ModelOutput subclass when its module is imported), and the cache classes those modeling modules
    define outside `Cache`'s hierarchy (`is_model_cache_class`: Reformer's, DeepSeek-V4's), registered with them."""
    from transformers.cache_utils import Cache
    from transformers.utils import ModelOutput

    from hfexport.core.cache_classes import is_model_cache_class

    return (
        issubclass(cls, Cache)
        or is_model_cache_class(cls)
        or (issubclass(cls, ModelOutput) and cls.__module__.startswith("transformers."))
    )


def process_state(*models: torch.nn.Module) -> ProcessState:
    namespaces = {
        "torch.Tensor": _namespace(torch.Tensor),
        "torch.nn.Module": _namespace(torch.nn.Module),
        "torch": _namespace(torch),
        "torch.nn.functional": _namespace(torch.nn.functional),
    }
    for model in models:
        for module in model.modules():
            for cls in type(module).__mro__:
                if cls.__module__.startswith("transformers"):
                    namespaces[f"{cls.__module__}.{cls.__qualname__}"] = _namespace(cls)
            namespaces[type(module).__module__] = _namespace(sys.modules[type(module).__module__])
    return ProcessState(namespaces, _patch_targets(), torch.is_grad_enabled(), set(torch.utils._pytree.SUPPORTED_NODES))


def assert_process_clean(before: ProcessState) -> None:
    assert installed_gates() == [], f"module-function gates left installed: {installed_gates()}"
    assert torch._C._len_torch_function_stack() == 0, "a TorchFunctionMode is still on the stack"
    assert not torch.compiler.is_exporting() and not torch.compiler.is_compiling()
    assert torch.is_grad_enabled() == before.grad_enabled
    nodes = sorted(c.__qualname__ for c in set(torch.utils._pytree.SUPPORTED_NODES) - before.pytree_nodes)
    strays = [c for c in set(torch.utils._pytree.SUPPORTED_NODES) - before.pytree_nodes if not lasting_pytree_node(c)]
    assert not strays, f"pytree nodes registered that are neither cache nor ModelOutput classes: {strays} ({nodes})"
    after = _patch_targets()
    assert after == before.targets, f"patch targets replaced: {[k for k in after if after[k] != before.targets[k]]}"
    for name, old in before.namespaces.items():
        new = _current_namespace(name)
        replaced = sorted(k for k in old if k in new and new[k] != old[k])
        assert not replaced, f"{name}: {replaced} replaced"
        added = sorted(set(new) - set(old))
        if name in ("torch", "torch.nn.functional"):
            # Lazily imported submodules (torch._dynamo, torch.onnx, ...) appear on first use, and importing
            # ExecuTorch adds `torch._thread_safe_fork`: only modules (test_what_stays_after_an_export below).
            added = [k for k in added if not inspect.ismodule(getattr(sys.modules[name], k, None))]
        assert not added, f"{name}: new attributes {added}"


def _current_namespace(name: str) -> dict[str, int]:
    if name in sys.modules:
        return _namespace(sys.modules[name])
    if name == "torch.Tensor":
        return _namespace(torch.Tensor)
    if name == "torch.nn.Module":
        return _namespace(torch.nn.Module)
    module_name, qualname = name, ""
    while module_name not in sys.modules:
        module_name, _, last = module_name.rpartition(".")
        qualname = f"{last}.{qualname}" if qualname else last
    owner: Any = sys.modules[module_name]
    for part in qualname.split("."):
        owner = getattr(owner, part)
    return _namespace(owner)


@contextmanager
def untouched(model: torch.nn.Module, inputs: Mapping[str, Any] | None = None) -> Iterator[None]:
    """Assert on exit (also after an exception the body expects) that model, inputs and process are as before."""
    model_before, process_before = model_state(model), process_state(model)
    inputs_before = input_state(inputs) if inputs is not None else None
    yield
    assert_model_untouched(model, model_before)
    assert_process_clean(process_before)
    if inputs is not None and inputs_before is not None:
        assert_inputs_untouched(inputs, inputs_before)


# -- tests ------------------------------------------------------------------------------------------------------
def _backend_param(backend: str) -> Any:
    # The default tier checks ONNX and OpenVINO in tests/test_reliability_faults.py (the export after a failed
    # save is wrapped in `untouched`); ExecuTorch's edge lowering alone takes 20-50 s: the slow tier runs them.
    return backend if backend == "dynamo" else pytest.param(backend, marks=pytest.mark.slow)


@pytest.mark.parametrize("backend", [_backend_param(b) for b in BACKENDS])
def test_a_successful_export_leaves_model_inputs_and_process_untouched(backend: str) -> None:
    skip_without(backend)
    model, inputs = micro_moe(), sample_inputs()
    expected = eager_logits(model, inputs)
    with untouched(model, inputs):
        program, exporter = export(model, inputs, backend, dynamic=True)
    if backend == "dynamo":
        # Dynamo keeps grouped_mm as it is (seed 000): the batched experts are the other backends'.
        assert {o.id: o.status for o in exporter.report.rules}["patch/moe-batched-experts"] == "other-backend"
    else:
        assert exporter.report.fired, "the MoE patch or a backend rule should have fired"
    assert torch.equal(eager_logits(model, inputs), expected), "eager outputs changed"
    assert_close_to(run_logits(program, backend, inputs), expected, backend)


def test_a_model_in_training_mode_is_exported_in_eval_mode_and_left_training() -> None:
    """Decision (docs/reliability.md): warn and export in eval mode (dropout off), then restore the flags."""
    model, inputs = micro_llama(), sample_inputs()
    expected = eager_logits(model, inputs)
    model.train()
    model.model.layers[0].eval()  # a mixed state must come back as it was, module by module
    with untouched(model, inputs):
        program, exporter = export(model, inputs, "dynamo")
    assert any("training mode" in w and "eval mode" in w for w in exporter.report.warnings)
    assert model.training and not model.model.layers[0].training
    assert_close_to(run_logits(program, "dynamo", inputs), expected, "dynamo")


def test_a_flash_attention_model_is_traced_with_sdpa_and_keeps_its_setting() -> None:
    model, inputs = micro_llama(), sample_inputs()
    expected = eager_logits(model, inputs)
    model.config._attn_implementation_internal = "flash_attention_2"
    with untouched(model, inputs):
        program, exporter = export(model, inputs, "dynamo")
    assert model.config._attn_implementation_internal == "flash_attention_2"
    assert any("flash_attention_2" in w and "sdpa" in w for w in exporter.report.warnings)
    assert_close_to(run_logits(program, "dynamo", inputs), expected, "dynamo")


def test_export_for_generation_leaves_model_untouched_and_generate_unchanged() -> None:
    model, inputs = micro_llama(), sample_inputs()
    generate_kwargs = {**inputs, "max_new_tokens": 3, "do_sample": False}
    with torch.no_grad():
        expected = model.generate(**generate_kwargs)
    generation_config = model.generation_config.to_json_string()
    with untouched(model, inputs):
        components = AutoHfExporter.from_config(config_for("dynamo", dynamic=True)).export_for_generation(
            model, generate_kwargs, config_for("dynamo", dynamic=True)
        )
    assert set(components) >= {"prefill", "decode"} or components, components
    assert model.generation_config.to_json_string() == generation_config
    assert generate_kwargs["max_new_tokens"] == 3 and set(generate_kwargs) == {*inputs, "max_new_tokens", "do_sample"}
    with torch.no_grad():
        assert torch.equal(model.generate(**generate_kwargs), expected)


# -- issue #21, item 11: what an export leaves in the process on purpose ------------------------------------------
_WHAT_STAYS = """
import inspect, json, sys
import torch
import torch.utils._pytree as pytree
sys.path.insert(0, {root!r})
from tests.test_reliability_invariants import export, lasting_pytree_node, micro_llama, sample_inputs

def snapshot():
    return (set(pytree.SUPPORTED_NODES), set(vars(torch)), set(dir(torch.ops)))

def added(before, after):
    nodes, names, ops = (a - b for a, b in zip(after, before))
    kept = [c.__qualname__ for c in nodes if lasting_pytree_node(c)]
    return {{
        "cache_nodes": sorted(n for n in kept if "Cache" in n),
        "output_nodes": sorted(n for n in kept if "Cache" not in n),
        "other_nodes": sorted(c.__qualname__ for c in nodes if not lasting_pytree_node(c)),
        "torch": sorted(names),
        "torch_non_modules": sorted(n for n in names if not inspect.ismodule(getattr(torch, n))),
        "ops": sorted(ops),
    }}

model, inputs = micro_llama(), sample_inputs()
first = snapshot()
{action}
second = snapshot()
export(model, inputs, "dynamo")
print("RESULT" + json.dumps([added(first, second), added(second, snapshot())]))
"""


def _what_stays(action: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """In a fresh interpreter: what `action` (a line of Python) adds to the process, then what a Dynamo export
    after it adds."""
    import json
    import subprocess
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[1])
    script = _WHAT_STAYS.format(root=root, action=action)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, cwd=root)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT")), None)
    assert line is not None, done.stderr[-3000:]
    first, then = json.loads(line.removeprefix("RESULT"))
    return first, then


def test_what_stays_after_the_first_export_is_the_cache_pytree_nodes_and_imported_model_outputs() -> None:
    """docs/reliability.md, "What stays": the first export registers every transformers Cache class as a pytree
    node, for the process lifetime (a program with cache inputs is called and saved through them), and imports
    the modeling modules its patch rules target, whose ModelOutput classes transformers registers. Nothing else: no
    other pytree node, no attribute of `torch`, no `torch.ops` namespace. A second export adds nothing."""
    first, then = _what_stays('export(model, inputs, "dynamo")')
    assert {"Cache", "DynamicCache", "StaticCache", "EncoderDecoderCache"} <= set(first["cache_nodes"]), first
    assert first["other_nodes"] == [] and first["torch"] == [] and first["ops"] == [], first
    assert all("Output" in name for name in first["output_nodes"]), first
    assert then == {k: [] for k in then}, then


def test_importing_executorch_adds_a_torch_submodule_and_its_operator_namespaces() -> None:
    """docs/reliability.md, "What stays": an ExecuTorch export imports `executorch.exir`, which adds the module
    `torch._thread_safe_fork` and registers its operator libraries (torch.ops.dim_order_ops, ...) for the process
    lifetime; no other attribute of `torch`. (executorch==1.4.1: a newer one that adds more fails here, and the doc
    is updated with it.)"""
    skip_without("executorch")
    first, then = _what_stays("import executorch.exir")
    assert first["torch"] == ["_thread_safe_fork"] and first["torch_non_modules"] == [], first
    assert set(first["ops"]) <= {
        "EDGE_DO_NOT_DECOMP",
        "dim_order_ops",
        "et_copy",
        "executorch_prim",
        "llama",
        "quant_fusion",
        "tr_c10d",
    }, first
    assert first["cache_nodes"] == [] and first["other_nodes"] == [], first
    assert then["other_nodes"] == [] and then["torch"] == [] and then["ops"] == [], then
