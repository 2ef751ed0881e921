"""Issue #8, item 4: exports and threads.

What the engine does (docs/reliability.md, "Concurrency"): exports in one process are serialised by a
process-wide reentrant lock (`hfexport.exporters.EXPORT_LOCK`), because torch.export itself sets process-wide
state while it traces; with it they hold TorchDynamo's compile lock, so a torch.compile in another thread waits
for the export (issue #21, item 5; what other threads still see, `is_exporting()` and torch.fx's
`Module.__call__` wrapper, is tested at the end). An eager forward in another thread does not take the lock and
runs during the export; it never sees a patch: method patches are bound on the exported model's own instances and
run their replacement only in the exporting thread, module-function gates dispatch on a ContextVar that only the
exporting context has set, and torch-function patches live in a thread-local TorchFunctionMode.

The "during" is made certain with the engine's test hook: at the point where a patch replacement is about to run
inside the trace, the hook runs the other thread's forward to completion.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any

import pytest
import torch

from hfexport.core.errors import HfExportError
from hfexport.rewrites.engine import fault_injection, stage_listener
from hfexport.rewrites.kinds.patch import MethodPatch, PatchSession, installed_gates
from hfexport.rewrites.rule import RuleMeta
from tests.test_reliability_invariants import (
    assert_close_to,
    assert_process_clean,
    eager_logits,
    export,
    micro_llama,
    micro_moe,
    process_state,
    run_logits,
    sample_inputs,
    skip_without,
)


class _Stop(BaseException):
    """Ends an export early, once the part under test has run."""


def _export_in_threads(models: list[torch.nn.Module]) -> tuple[list[Any], list[tuple[int, str]]]:
    """Export each model (dynamo) in its own thread, all started together; (programs, stage events in order)."""
    events: list[tuple[int, str]] = []
    results: list[Any] = [None] * len(models)
    errors: list[BaseException] = []
    start = threading.Barrier(len(models))

    def work(index: int, model: torch.nn.Module) -> None:
        try:
            start.wait()
            with stage_listener(lambda stage: events.append((index, stage))):
                results[index], _ = export(model, sample_inputs(index), "dynamo")
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i, m)) for i, m in enumerate(models)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert not errors, errors
    return results, events


def _assert_serialised(events: list[tuple[int, str]], count: int) -> None:
    """Each export's stages form one block: no stage of one export ran between two stages of another."""
    order = [index for index, _ in events]
    blocks = [order[0]] + [b for a, b in itertools.pairwise(order) if a != b]
    assert sorted(blocks) == list(range(count)), f"interleaved stages: {events}"


def test_exports_in_threads_of_different_models_and_of_the_same_class_are_serialised_and_all_correct() -> None:
    """Three threads: a Llama and two Qwen3-MoE instances (a pair of different models, a pair of the same class)."""
    models = [micro_llama(), micro_moe(seed=0), micro_moe(seed=1)]
    before = process_state(*models)
    programs, events = _export_in_threads(models)
    _assert_serialised(events, len(models))
    for index, (model, program) in enumerate(zip(models, programs, strict=True)):
        inputs = sample_inputs(index)
        assert_close_to(run_logits(program, "dynamo", inputs), eager_logits(model, inputs), "dynamo")
    assert_process_clean(before)


def _forward_elsewhere_during(
    backend: str, rule_id: str, bystanders: list[torch.nn.Module], exported: torch.nn.Module
) -> tuple[list[torch.Tensor], dict[str, int], list[str]]:
    """Export `exported`, stopped after the trace; when `rule_id`'s replacement is about to run inside the trace,
    run every bystander's eager forward in another thread. (outputs, hits per rule, gates installed meanwhile)."""
    inputs = sample_inputs()
    outputs: list[torch.Tensor] = []
    gates: list[str] = []
    errors: list[BaseException] = []

    def bystander() -> None:
        try:
            outputs.extend(eager_logits(model, inputs) for model in bystanders)
        except BaseException as exc:
            errors.append(exc)

    def hook(stage: str, current: str | None) -> None:
        if (stage, current) == ("trace", rule_id) and not outputs:
            gates.extend(installed_gates())
            thread = threading.Thread(target=bystander)
            thread.start()
            thread.join(120)
        if stage == "fx":
            raise _Stop

    from hfexport import AutoExportConfig, AutoHfExporter

    config = AutoExportConfig.from_dict({"export_format": backend})
    exporter = AutoHfExporter.from_config(config)
    with fault_injection(hook), contextlib.suppress(_Stop):
        exporter.export(exported, inputs, config=config)
    assert not errors, errors
    assert len(outputs) == len(bystanders), "the hook never ran the bystanders: the rule did not fire"
    hits = {rule.id: rule.hits for rule in exporter.report.rules}
    return outputs, hits, gates


def _solo_hits(backend: str, model: torch.nn.Module) -> dict[str, int]:
    from hfexport import AutoExportConfig, AutoHfExporter

    def stop(stage: str, _: str | None) -> None:
        if stage == "fx":
            raise _Stop

    config = AutoExportConfig.from_dict({"export_format": backend})
    exporter = AutoHfExporter.from_config(config)
    with fault_injection(stop), contextlib.suppress(_Stop):
        exporter.export(model, sample_inputs(), config=config)
    return {rule.id: rule.hits for rule in exporter.report.rules}


def test_an_eager_forward_in_another_thread_during_an_export_does_not_see_the_module_function_patch() -> None:
    """patch/mamba-selective-scan-hop gates a transformers function: other threads run the original."""
    from hfexport.tiny import get_tiny_model

    mamba = get_tiny_model("tiny-mamba")
    exported, other, unrelated = mamba.build(seed=0), mamba.build(seed=1), micro_llama()
    inputs = sample_inputs()
    expected = [eager_logits(other, inputs), eager_logits(unrelated, inputs)]
    # Dynamo, where the scan patch runs; the export stops after the trace.
    solo = _solo_hits("dynamo", mamba.build(seed=0))
    outputs, hits, gates = _forward_elsewhere_during(
        "dynamo", "patch/mamba-selective-scan-hop", [other, unrelated], exported
    )
    assert gates, "the gate was not installed while the other thread ran: nothing was tested"
    # The other thread ran the original code: no call of it went through the replacement (the hit count equals
    # an export alone), and its logits equal eager's to float rounding. Not bit for bit: on 2026-12-02's machine
    # the forward run during the export differed by 2.4e-7 (|logits| ~ 0.01) at this test's own base commit too;
    # what the export leaves visible to other threads (docs/reliability.md) may change a kernel's summation order.
    for got, want in zip(outputs, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert hits["patch/mamba-selective-scan-hop"] == solo["patch/mamba-selective-scan-hop"] > 0


def test_an_eager_forward_in_another_thread_during_an_export_does_not_see_the_method_patch() -> None:
    """patch/moe-batched-experts is bound on the exported model's expert modules only: another instance of
    the class, run in another thread during the trace, runs the original method."""
    skip_without("openvino")
    exported, other = micro_moe(seed=0), micro_moe(seed=1)
    inputs = sample_inputs()
    expected = [eager_logits(other, inputs)]
    solo = _solo_hits("openvino", micro_moe(seed=0))
    outputs, hits, _ = _forward_elsewhere_during("openvino", "patch/moe-batched-experts", [other], exported)
    for got, want in zip(outputs, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert hits["patch/moe-batched-experts"] == solo["patch/moe-batched-experts"] > 0


def test_an_export_that_fails_in_one_thread_does_not_block_or_break_the_next() -> None:
    """A failure releases the lock: a second thread's export, waiting for it, then succeeds."""
    failing, fine = micro_moe(seed=0), micro_llama()
    errors: list[BaseException] = []

    def fail_at_trace(stage: str, _: str | None) -> None:
        if stage == "trace":
            raise RuntimeError("fault injected at trace")

    def failing_export() -> None:
        with fault_injection(fail_at_trace):
            try:
                export(failing, sample_inputs(), "dynamo")
            except HfExportError as exc:
                errors.append(exc)

    thread = threading.Thread(target=failing_export)
    thread.start()
    thread.join(120)
    assert len(errors) == 1 and errors[0].stage == "trace"
    program, _ = export(fine, sample_inputs(), "dynamo")
    assert_close_to(run_logits(program, "dynamo", sample_inputs()), eager_logits(fine, sample_inputs()), "dynamo")


class _Experts(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


def test_a_method_patch_runs_its_replacement_only_in_the_thread_that_installed_it() -> None:
    """The exported instance itself, called from another thread while its method patch is installed, runs the
    original method. (An end-to-end version cannot exist: during a non-strict trace torch.export swaps the
    instance's parameters for fake tensors, so the instance being exported must not be run elsewhere meanwhile.)"""
    rule = MethodPatch(
        RuleMeta(
            id="patch/test-triple",
            why="test",
            upstream="hfexport==0 tests",
            backends=("dynamo",),
            models=(),
            kind="fix",
            examples=(),
        ),
        target=lambda module: isinstance(module, _Experts),
        method="forward",
        replacement=lambda original, module, x: x * 3,
    )
    model, x = _Experts(), torch.ones(2)
    seen: list[torch.Tensor] = []
    with PatchSession(lambda rule_id: None) as session:
        assert session.install(rule, model) is None
        with session.active():
            assert torch.equal(model(x), x * 3)
            thread = threading.Thread(target=lambda: seen.append(model(x)))
            thread.start()
            thread.join(30)
    assert torch.equal(seen[0], x * 2)
    assert "forward" not in vars(model)


# -- issue #21, item 5: what other threads see of torch.export's process-wide state --------------------------
def _run_elsewhere_at(point: tuple[str, str | None], backend: str, model: torch.nn.Module, work: Any) -> Any:
    """Export `model` (stopped after the trace); at `point` of the export, run `work()` in another thread to the
    end and return what it returned."""
    result: list[Any] = []
    errors: list[BaseException] = []

    def run() -> None:
        try:
            result.append(work())
        except BaseException as exc:
            errors.append(exc)

    def hook(stage: str, current: str | None) -> None:
        if (stage, current) == point and not result and not errors:
            thread = threading.Thread(target=run)
            thread.start()
            thread.join(120)
        if stage == "fx":
            raise _Stop

    with fault_injection(hook), contextlib.suppress(_Stop):
        export(model, sample_inputs(), backend)
    assert not errors, errors
    assert result, f"the export never reached {point}"
    return result[0]


class _RecordingBackend:
    """A torch.compile backend that records, for each compile, whether the export under test had finished."""

    def __init__(self, export_finished: threading.Event) -> None:
        self.export_finished = export_finished
        self.finished_when_compiled: list[bool] = []
        self.entered = threading.Event()

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        self.finished_when_compiled.append(self.export_finished.is_set() and not torch.compiler.is_exporting())
        self.entered.set()
        return gm.forward


def test_during_the_trace_other_threads_see_is_exporting_and_torch_fx_module_call_wrapper() -> None:
    """Not isolated (docs/reliability.md, "Concurrency"): torch.export's non-strict trace sets the process-wide
    `torch.compiler.is_exporting()` flag and replaces `torch.nn.Module.__call__` by torch.fx's tracing wrapper, for
    every thread; another thread's eager forward runs through it (bit-identical to eager for these models). A
    torch.compile'd model called then never compiles inside the export: it runs eagerly or its (re)compile waits for
    the export to end. If torch makes the flag or the wrapper thread-local, this test says so."""
    skip_without("openvino")  # the point inside the trace is the OpenVINO experts patch's replacement
    original_call = torch.nn.Module.__call__
    other = micro_llama(seed=1)
    inputs = sample_inputs()
    expected = eager_logits(other, inputs)
    finished = threading.Event()
    backend = _RecordingBackend(finished)
    compiled = torch.compile(other, backend=backend)
    finished.set()
    torch.testing.assert_close(eager_logits(compiled, inputs), expected, rtol=0, atol=0)  # compiled before
    finished.clear()
    before = process_state(other)
    compiled_outputs: list[torch.Tensor] = []
    compiled_call = threading.Thread(target=lambda: compiled_outputs.append(eager_logits(compiled, inputs)))

    def look() -> dict[str, Any]:
        compiled_call.start()  # not joined: it may wait for the export to end
        return {
            "exporting": torch.compiler.is_exporting(),
            "module_call_replaced": torch.nn.Module.__call__ is not original_call,
            "eager": eager_logits(other, inputs),
        }

    seen = _run_elsewhere_at(("trace", "patch/moe-batched-experts"), "openvino", micro_moe(), look)
    finished.set()
    compiled_call.join(120)
    assert seen["exporting"] and seen["module_call_replaced"]
    torch.testing.assert_close(seen["eager"], expected, rtol=0, atol=0)
    torch.testing.assert_close(compiled_outputs[0], expected, rtol=0, atol=0)
    assert all(backend.finished_when_compiled), backend.finished_when_compiled
    assert not torch.compiler.is_exporting() and torch.nn.Module.__call__ is original_call
    assert_process_clean(before)
    torch._dynamo.reset()


def test_a_torch_compile_started_in_another_thread_during_an_export_waits_for_the_export() -> None:
    """Isolated: an export holds TorchDynamo's compile lock with `EXPORT_LOCK`, so a compile in another thread runs
    after the export, outside its process-wide state. (Before, the two traced at once: in a loop of exports and
    compiles in two threads, both failed, with "Trying to pop empty mode stack", "CURRENT_PATCHER is None",
    SpeculationLogDivergence.)"""
    finished = threading.Event()
    backend = _RecordingBackend(finished)

    def double_plus_one(x: torch.Tensor) -> torch.Tensor:
        return x * 2 + 1

    outputs: list[torch.Tensor] = []
    thread = threading.Thread(
        target=lambda: outputs.append(torch.compile(double_plus_one, backend=backend)(torch.ones(3)))
    )
    waited: list[bool] = []

    def hook(stage: str, current: str | None) -> None:
        if stage == "fx" and not waited:
            thread.start()
            # Compiling this function takes well under a second: before the fix, it compiled here.
            waited.append(not backend.entered.wait(5))

    model = micro_llama()
    with fault_injection(hook):
        program, _ = export(model, sample_inputs(), "dynamo")
    finished.set()
    thread.join(120)
    assert waited == [True], "the other thread compiled while the export ran"
    assert backend.finished_when_compiled == [True] and torch.equal(outputs[0], torch.full((3,), 3.0))
    assert_close_to(run_logits(program, "dynamo", sample_inputs()), eager_logits(model, sample_inputs()), "dynamo")
    torch._dynamo.reset()


def test_a_compiler_disabled_call_in_another_thread_during_the_trace_writes_torch_fx_s_process_wide_metadata() -> None:
    """Not isolated (issue #39, item 7; docs/reliability.md, "Concurrency"): a function under
    `torch.compiler.disable` (a compiled model calls such wrappers around the code it does not compile) sees
    `is_exporting()` in another thread and enters `torch.fx.traceback.annotate`, which writes into the module-global
    `current_meta` the export's trace reads (its nodes take `meta["custom"]` from it) and that the export's
    `preserve_node_meta` replaces when it ends. With the two interleaved, the compiled call fails with
    `KeyError: 'custom'` (53 of 1965 calls of a compiled Llama during three ONNX exports). torch keeps this state
    per process (pytorch/pytorch#184917 makes it thread-local); when it does, this test says so."""
    seen: list[dict[str, Any]] = []

    @torch.compiler.disable
    def look() -> dict[str, Any]:
        custom = torch.fx.traceback.current_meta.get("custom")
        return {"exporting": torch.compiler.is_exporting(), "custom": dict(custom) if custom else None}

    class CallsElsewhere(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not seen:  # during the trace: another thread runs `look` to the end
                thread = threading.Thread(target=lambda: seen.append(look()))
                thread.start()
                thread.join(60)
            return x * 2

    skip_without("onnx")
    export(CallsElsewhere(), {"x": torch.ones(2, 3)}, "onnx")
    assert seen[0]["exporting"]
    assert seen[0]["custom"] == {
        "_torchdynamo_disable": True,
        "_torchdynamo_disable_recursive": True,
        "_torchdynamo_disable_method": "look",
    }
    assert "custom" not in torch.fx.traceback.current_meta


@pytest.mark.parametrize(
    ("export_format", "compile_backend"),
    [
        pytest.param("dynamo", lambda gm, example_inputs: gm.forward, id="dynamo"),
        # The case of issue #39 item 7: AOTAutograd's runtime wrappers run under torch.compiler.disable.
        pytest.param("onnx", "aot_eager", id="onnx-aot-eager"),
    ],
)
def test_a_thread_that_holds_export_lock_never_overlaps_an_export(export_format: str, compile_backend: Any) -> None:
    """The recipe for code that must not see an export at all (a compiled model's calls, a forward that reads
    `torch.compiler.is_exporting()`): hold `hfexport.exporters.EXPORT_LOCK` around it. Without it, the same loop of
    compiled (aot_eager) calls during ONNX exports failed with `KeyError: 'custom'` (53 of 1965 calls, three
    exports); with it, none does, and every output equals eager."""
    from hfexport.exporters import EXPORT_LOCK

    skip_without(export_format)
    other = micro_llama(seed=1)
    inputs = sample_inputs()
    expected = eager_logits(other, inputs)
    compiled = torch.compile(other, backend=compile_backend)
    torch.testing.assert_close(eager_logits(compiled, inputs), expected, rtol=0, atol=0)  # compiled before
    seen: list[tuple[bool, bool]] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def calls() -> None:
        while not stop.is_set():
            try:
                with EXPORT_LOCK:
                    exporting = torch.compiler.is_exporting() or torch.fx._symbolic_trace.is_fx_tracing()
                    seen.append((exporting, torch.equal(eager_logits(compiled, inputs), expected)))
            except BaseException as exc:  # reported by the main thread
                errors.append(exc)

    thread = threading.Thread(target=calls)
    thread.start()
    model = micro_llama()
    try:
        program, _ = export(model, sample_inputs(), export_format)
    finally:
        stop.set()
        thread.join(120)
    assert not errors, errors[:3]
    assert seen and all(not exporting and equal for exporting, equal in seen), seen[:5]
    assert_close_to(
        run_logits(program, export_format, sample_inputs()), eager_logits(model, sample_inputs()), export_format
    )
    torch._dynamo.reset()
