"""A `.pte` edited inside its flatbuffer (the manifest re-hashed) is refused by `hfexport.load`, never run.

Each hostile program is the tiny `y = x @ W` export (portable kernels, or XNNPACK), decoded with ExecuTorch's
own serializer, made inconsistent in one way the runtime trusts, and encoded again (or, where the serializer
cannot express the fault, patched byte for byte at the field `hfexport/artifacts/pte.py` reads). All are loaded
in one child process (`tests/loading_child.py`), so a runtime that aborts fails the test instead of ending it.
Without the structural check, the edits marked "crash" here abort or crash the process (issue #21).
"""

from __future__ import annotations

import random
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("executorch")

from executorch.exir import schema as et
from executorch.exir._serialize._program import deserialize_pte_binary, serialize_pte_binary
from executorch.exir._serialize.generated.executorch_flatbuffer.KernelTypes import KernelTypes

from hfexport.artifacts import ArtifactError, load, pte, save
from hfexport.artifacts.flatbuffer import READS_PER_BYTE, Reader, Table
from hfexport.artifacts.pte_operators import INT_LIST, OPTIONAL_TENSOR_LIST, TENSOR_LIST
from hfexport.backends.executorch.artifact import check_pte
from hfexport.runtime.executorch import ExecutorchProgram
from tests.flatbuffer_programs import Shape, program
from tests.loading_child import Job, flatbuffer_flips, load_in_child, write_edited

_X = {"x": ([2, 4], "float32")}


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(4, 3, generator=torch.Generator().manual_seed(0)))

    def forward(self, x: Any) -> Any:
        return x @ self.weight


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny export saved as an artifact: portable kernels (`mm.out`) and XNNPACK (one delegate call)."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    root = tmp_path_factory.mktemp("pte")
    program = torch.export.export(_Tiny().eval(), (), {"x": torch.ones(2, 4)})
    portable = to_edge_transform_and_lower(program).to_executorch()
    xnnpack = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch()
    return {"portable": save(portable, root / "portable"), "xnnpack": save(xnnpack, root / "xnnpack")}


def _encode(source: Path, edit: Callable[[et.ExecutionPlan, et.Program], None]) -> bytes:
    pte = deserialize_pte_binary((source / "model.pte").read_bytes())
    edit(pte.program.execution_plan[0], pte.program)
    return bytes(serialize_pte_binary(pte, extract_delegate_segments=True))


def _patch(source: Path, field: Callable[[Table], tuple[int, bytes]]) -> bytes:
    """The file with bytes replaced at the position `field` finds from the program's root table."""
    data = bytearray((source / "model.pte").read_bytes())
    position, replacement = field(Reader(bytes(data), len(data)).root())
    data[position : position + len(replacement)] = replacement
    return bytes(data)


def _string_start(table: Table, slot: int) -> int:
    at = table._field(slot, 4)
    return at + table.r.read("I", at, "") + 4


def _tensor(plan: et.ExecutionPlan, index: int) -> Any:
    return plan.values[index].val


def _kernel(plan: et.ExecutionPlan) -> et.KernelCall:
    return plan.chains[0].instructions[0].instr_args


def _add(plan: et.ExecutionPlan, *values: Any) -> list[int]:
    """Append values; their indices."""
    start = len(plan.values)
    plan.values.extend(et.EValue(v) for v in values)
    return list(range(start, start + len(values)))


def _append(plan: et.ExecutionPlan, call: Any) -> None:
    plan.chains[0].instructions.append(et.Instruction(call))


def _unplanned_copy(plan: et.ExecutionPlan, program: et.Program) -> None:
    out = _tensor(plan, 2)
    (index,) = _add(plan, et.Tensor(**{**out.__dict__, "allocation_info": None}))
    _kernel(plan).args = [1, 0, index, index]


def _set(obj: Any, **fields: Any) -> None:
    for key, value in fields.items():
        setattr(obj, key, value)


def _prim_result(plan: et.ExecutionPlan, program: et.Program) -> None:
    plan.operators.append(et.Operator("executorch_prim::add", "Scalar"))
    a, b = _add(plan, et.Int(1), et.Int(2))
    _append(plan, et.KernelCall(len(plan.operators) - 1, [a, b, 2]))


# (id, portable or xnnpack, how the program is made inconsistent, what the refusal says). "crash": without the
# check the runtime aborts or crashes on it (measured with tools/fuzz_pte.py and these cases, issue #21).
_CASES: list[tuple[str, str, Callable[[Path], bytes], str]] = [
    # values the method takes and returns
    (
        "input index past the values (crash)",
        "portable",
        lambda s: _encode(s, lambda p, g: _set(p, inputs=[7])),
        "input 0 is value 7",
    ),
    (
        "output of a type a method cannot return",
        "portable",
        lambda s: _encode(s, lambda p, g: _set(p, outputs=_add(p, et.IntList([])))),
        "output 0 is a int[]",
    ),
    # kernel calls
    (
        "kernel argument of the wrong type (crash)",
        "portable",
        lambda s: _encode(s, lambda p, g: _set(_kernel(p), args=[1, _add(p, et.Int(3))[0], 2, 2])),
        "argument 1 of aten::mm.out is a int",
    ),
    (
        "too few kernel arguments",
        "portable",
        lambda s: _encode(s, lambda p, g: _set(_kernel(p), args=[1, 0, 2])),
        "passes 3 arguments to aten::mm.out, which takes 4",
    ),
    (
        "kernel argument index past the values",
        "portable",
        lambda s: _encode(s, lambda p, g: _set(_kernel(p), args=[1, 0, 2, 9])),
        "argument 3 is value 9",
    ),
    (
        "operator index past the operators",
        "portable",
        lambda s: _encode(s, lambda p, g: _set(_kernel(p), op_index=4)),
        "calls operator 4",
    ),
    (
        "operator name that is not UTF-8 (crash)",
        "portable",
        lambda s: _patch(s, lambda t: (_string_start(t.tables(1, "")[0].tables(6, "")[0], 0) + 7, b"\xcc")),
        "not UTF-8",
    ),
    (
        "operator hfexport cannot type-check",
        "portable",
        lambda s: _encode(s, lambda p, g: _set(p.operators[0], name="aten::no_such_op")),
        "does not know",
    ),
    (
        "prim operator writing an int into a tensor",
        "portable",
        lambda s: _encode(s, _prim_result),
        "writes int into a Tensor",
    ),
    # tensors
    (
        "scalar type ExecuTorch does not define",
        "portable",
        lambda s: _patch(s, lambda t: (t.tables(1, "")[0].tables(2, "")[0].table(1, "")._field(0, 1), b"\x1e")),
        "scalar type 30",
    ),
    (
        "negative size",
        "portable",
        lambda s: _encode(s, lambda p, g: _set(_tensor(p, 1), sizes=[2, -4])),
        "negative size",
    ),
    (
        "dim order that is not a permutation",
        "portable",
        lambda s: _encode(s, lambda p, g: _set(_tensor(p, 0), dim_order=[0, 0])),
        "not a permutation",
    ),
    (
        "unbounded dynamic shape",
        "portable",
        lambda s: _encode(s, lambda p, g: _set(_tensor(p, 1), shape_dynamism=et.TensorShapeDynamism.DYNAMIC_UNBOUND)),
        "shape dynamism 2",
    ),
    (
        "tensor past the end of its planned buffer",
        "portable",
        lambda s: _encode(s, lambda p, g: _set(_tensor(p, 2).allocation_info, memory_offset_low=1 << 20)),
        "past the end of planned buffer 1",
    ),
    (
        "tensor in a planned buffer that does not exist",
        "portable",
        lambda s: _encode(s, lambda p, g: _set(_tensor(p, 2).allocation_info, memory_id=3)),
        "planned in buffer 3",
    ),
    (
        "constant larger than its data",
        "portable",
        lambda s: _encode(s, lambda p, g: _set(_tensor(p, 0), sizes=[4, 300])),
        "reads constant 1",
    ),
    (
        "tensor a kernel writes with no storage (crash)",
        "portable",
        lambda s: _encode(s, _unplanned_copy),
        "has no storage",
    ),
    # lists, moves, frees, jumps
    (
        "int list naming a tensor",
        "portable",
        lambda s: _encode(s, lambda p, g: _add(p, et.IntList([0]))),
        "(int[]) names value 0 (Tensor)",
    ),
    (
        "tensor list naming a value not yet parsed",
        "portable",
        lambda s: _encode(s, lambda p, g: _add(p, et.TensorList([3]))),
        "(Tensor[]) names value 3",
    ),
    (
        "move of a tensor into an int",
        "portable",
        lambda s: _encode(s, lambda p, g: _append(p, et.MoveCall(0, _add(p, et.Int(1))[0]))),
        "moves a Tensor into a int",
    ),
    (
        "free of an int",
        "portable",
        lambda s: _encode(s, lambda p, g: _append(p, et.FreeCall(_add(p, et.Int(1))[0]))),
        "frees a value that is not a tensor",
    ),
    (
        "jump past the chain",
        "portable",
        lambda s: _encode(s, lambda p, g: _append(p, et.JumpFalseCall(_add(p, et.Bool(False))[0], 99))),
        "jumps to instruction 99",
    ),
    # segments and delegates
    (
        "segment outside the file",
        "portable",
        lambda s: _patch(s, lambda t: (t.tables(4, "")[0]._field(1, 8), struct.pack("<Q", 1 << 20))),
        "lies outside the file",
    ),
    (
        "delegate index past the delegates",
        "xnnpack",
        lambda s: _encode(s, lambda p, g: _set(_kernel(p), delegate_index=3)),
        "calls delegate 3",
    ),
    (
        "delegate call with fewer arguments than its graph binds (crash)",
        "xnnpack",
        lambda s: _encode(s, lambda p, g: _set(_kernel(p), args=_kernel(p).args[:1])),
        "a delegate graph that binds 2",
    ),
    (
        "delegate payload in a segment that does not exist",
        "xnnpack",
        lambda s: _patch(
            s, lambda t: (t.tables(1, "")[0].tables(7, "")[0].table(1, "")._field(1, 4), struct.pack("<I", 5))
        ),
        "reads segment 5",
    ),
]


def test_every_structural_fault_is_refused_before_the_runtime_runs(tiny: dict[str, Path], tmp_path: Path) -> None:
    jobs, expected = [], {}
    for kind in ("portable", "xnnpack"):  # the round trip alone loads and runs: the edits are what is refused
        folder = write_edited(tiny[kind], tmp_path / f"roundtrip-{kind}", _encode(tiny[kind], lambda p, g: None))
        jobs.append(Job(f"roundtrip-{kind}", folder, inputs=_X))
    for i, (name, kind, make, message) in enumerate(_CASES):
        folder = write_edited(tiny[kind], tmp_path / f"case{i}", make(tiny[kind]))
        with pytest.raises(ArtifactError, match="ExecuTorch program"):  # the check itself, in this process
            check_pte(folder, {"main": "model.pte"})
        jobs.append(Job(name, folder, inputs=_X))
        expected[name] = message
    outcomes = load_in_child(jobs, watch=tmp_path)
    assert outcomes["roundtrip-portable"].kind == "loaded", outcomes["roundtrip-portable"].detail
    assert outcomes["roundtrip-xnnpack"].kind == "loaded", outcomes["roundtrip-xnnpack"].detail
    wrong = {
        name: (outcomes[name].kind, outcomes[name].detail[:300])
        for name, message in expected.items()
        if outcomes[name].kind != "refused" or message not in outcomes[name].detail
    }
    assert not wrong, wrong


def _lowered(dynamic: bool, xnnpack: bool, planned_io: bool) -> Any:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import ExecutorchBackendConfig, to_edge_transform_and_lower
    from executorch.exir.passes import MemoryPlanningPass

    shapes = {"x": {0: torch.export.Dim("batch", min=1, max=4)}} if dynamic else None
    program = torch.export.export(_Tiny().eval(), (), {"x": torch.ones(2, 4)}, dynamic_shapes=shapes)
    edge = to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()] if xnnpack else None)
    planning = MemoryPlanningPass(alloc_graph_input=planned_io, alloc_graph_output=planned_io)
    return edge.to_executorch(ExecutorchBackendConfig(memory_planning_pass=planning))


# Each option in both settings, in four programs rather than all eight combinations (each lowering takes seconds).
@pytest.mark.parametrize(
    ("dynamic", "xnnpack", "planned_io"),
    [(False, False, True), (True, True, True), (False, True, False), (True, False, False)],
    ids=["static-portable", "dynamic-xnnpack", "static-xnnpack-caller-io", "dynamic-portable-caller-io"],
)
def test_valid_programs_pass_and_the_reader_agrees_with_executorch(
    tmp_path: Path, dynamic: bool, xnnpack: bool, planned_io: bool
) -> None:
    """Valid programs (static or bounded-dynamic, portable or XNNPACK, inputs/outputs planned or the caller's)
    pass the check, and its flatbuffer reader sees what ExecuTorch's own deserializer sees (the field numbers
    of program.fbs it hard-codes have not drifted)."""
    manager = _lowered(dynamic, xnnpack, planned_io)
    folder = save(manager, tmp_path / "artifact")
    check_pte(folder, {"main": "model.pte"})
    data = (folder / "model.pte").read_bytes()
    plan = Reader(data, len(data)).root().tables(1, "")[0]
    expected = deserialize_pte_binary(data).program.execution_plan[0]
    assert plan.string(0, "") == expected.name
    assert [v.scalar(0, "B") for v in plan.tables(2, "")] == [
        getattr(KernelTypes, type(v.val).__name__) for v in expected.values
    ]
    # the tag numbers the check uses are those flatc generated from program.fbs
    assert {name: getattr(pte, name.upper()) for name in ("Null", "Int", "Bool", "Double", "Tensor", "String")} == {
        name: getattr(KernelTypes, name) for name in ("Null", "Int", "Bool", "Double", "Tensor", "String")
    }
    assert (
        KernelTypes.IntList,
        KernelTypes.TensorList,
        KernelTypes.OptionalTensorList,
    ) == (INT_LIST, TENSOR_LIST, OPTIONAL_TENSOR_LIST)
    assert plan.vector(3, "i", "") == expected.inputs and plan.vector(4, "i", "") == expected.outputs
    assert plan.vector(8, "q", "") == expected.non_const_buffer_sizes
    assert [op.string(0, "") for op in plan.tables(6, "")] == [op.name for op in expected.operators]
    sizes = [v.table(1, "").vector(2, "i", "") for v in plan.tables(2, "") if v.scalar(0, "B") == 5]
    assert sizes == [v.val.sizes for v in expected.values if isinstance(v.val, et.Tensor)]
    outputs = ExecutorchProgram(folder / "model.pte").run({"x": torch.ones(2, 4)})
    torch.testing.assert_close(outputs[0], _Tiny().eval()(torch.ones(2, 4)))
    # A program ExecuTorch writes reads each table a few times: far inside the check's read budget.
    reader = Reader(data, int.from_bytes(data[16:24], "little"))
    pte._check(reader, len(data), int.from_bytes(data[24:32], "little"))
    assert reader.spent < READS_PER_BYTE * reader.end / 8


@pytest.mark.parametrize(
    "shape",
    [
        pytest.param(Shape(plans=700, chains=700, instructions=700), id="plans-chains-instructions-8.6KB"),
        pytest.param(Shape(list_values=1000, list_items=1000), id="values-sharing-one-list-12KB"),
        pytest.param(Shape(plans=20, chains=20, instructions=20), id="small-456B"),
    ],
)
def test_a_program_whose_tables_are_shared_is_refused_in_well_under_a_second(
    tiny: dict[str, Path], tmp_path: Path, shape: Shape
) -> None:
    """Item 3b of issue #39: vectors whose entries all point at one table made the check visit it once per
    reference (P*C*I): 8.6 KB ran for more than 240 s (16 us a visit, 343 million visits). The reads are budgeted
    by the file's size: refused in milliseconds, by `load` before the runtime sees the file."""
    data = program(shape)
    folder = write_edited(tiny["portable"], tmp_path / "artifact", data)
    start = time.perf_counter()
    with pytest.raises(ArtifactError, match="more than 64 reads per byte"):
        load(folder)
    assert time.perf_counter() - start < 1.0
    # The same program with each table referenced a few times is consistent, and passes.
    small = program(Shape(plans=2, chains=3, instructions=4, list_values=5, list_items=6))
    pte.check_program(small, len(small), 0, "model.pte")


def _random_edits(source: Path, work: Path, edits: int, seed: int) -> tuple[list[Job], dict[str, list[Any]]]:
    data = (source / "model.pte").read_bytes()
    rng = random.Random(seed)
    jobs, flips = [], {}
    for i in range(edits):
        edited = bytearray(data)
        flips[str(i)] = flatbuffer_flips(data, rng)
        for position, byte in flips[str(i)]:
            edited[position] = byte
        jobs.append(Job(str(i), write_edited(source, work / str(i), bytes(edited)), inputs=_X))
    return jobs, flips


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "edits"), [("portable", 250), ("xnnpack", 100)])
def test_random_edits_inside_the_flatbuffer_load_and_run_or_are_refused(
    tiny: dict[str, Path], tmp_path: Path, kind: str, edits: int
) -> None:
    """Random byte flips inside the program flatbuffer (1-3 per edit, re-hashed): each loads and runs (or fails
    to run with an error), or is refused with an hfexport error; none aborts or crashes the loading process
    (before the structural check, 2 of 300 such edits of this portable program did, 8 of 300 of a tiny Llama's)."""
    jobs, flips = _random_edits(tiny[kind], tmp_path, edits, seed=21)
    outcomes = load_in_child(jobs, watch=tmp_path)
    bad = {
        str(flips[k]): (o.kind, o.detail[-300:])
        for k, o in outcomes.items()
        if o.kind not in ("loaded", "refused", "run-failed")
        # A run may fail cleanly: hfexport's own input check, or a kernel that finds its shapes inconsistent
        # and returns an error (`method->execute() failed with error 0x12`), raised as an exception.
        or (
            o.kind == "run-failed" and not o.detail.startswith(("InputError", "RuntimeError: method->execute() failed"))
        )
    }
    assert not bad, bad


class _SeveralOutputs(torch.nn.Module):
    """Portable kernels whose out variants have several outputs: `native_layer_norm.out` (clip_vision_model's
    load-error in the ExecuTorch sweep of 2026-12-02), `max.dim_max` (values and indices) and
    `split_with_sizes_copy.out` (returns nothing, writes a Tensor[]: siglip's load-error)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(4)

    def forward(self, x: Any) -> Any:
        y = self.norm(x)
        values, indices = y.max(dim=-1)
        first, rest = torch.split(y, [1, 3], dim=-1)
        return values, indices, first * 2, rest + 1


def test_out_variants_with_several_outputs_pass_and_run(tmp_path: Path) -> None:
    """executorch's emitter passes the outputs of a multi-output out variant as one TensorList argument: the
    check takes that layout (it refused `native_layer_norm.out` with "passes 9 arguments ..., which takes 11")."""
    from executorch.exir import to_edge_transform_and_lower

    from hfexport.artifacts import load

    model = _SeveralOutputs().eval()
    x = torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(1))
    manager = to_edge_transform_and_lower(torch.export.export(model, (), {"x": x})).to_executorch()
    names = {op.name for op in deserialize_pte_binary(manager.buffer).program.execution_plan[0].operators}
    # not delegated: the portable out variants
    assert {"aten::native_layer_norm", "aten::max", "aten::split_with_sizes_copy"} <= names
    folder = save(manager, tmp_path / "artifact")
    check_pte(folder, {"main": "model.pte"})
    values, indices, first, rest = load(folder, trust=True).run({"x": x}).values()  # named outputs, in order
    expected_values, expected_indices, expected_first, expected_rest = model(x)
    torch.testing.assert_close(values, expected_values)
    assert torch.equal(indices, expected_indices)
    torch.testing.assert_close(first, expected_first)
    torch.testing.assert_close(rest, expected_rest)


class _ScaleByLength(torch.nn.Module):
    """YOLOS' position grid: a float scale from a symbolic size (`128 / (height // 4)`), used as a scalar."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x: Any) -> Any:
        return self.proj(x) * (128 / (x.shape[1] // 4))


def test_a_prim_op_that_writes_a_double_into_its_int_placeholder_passes_and_runs(tmp_path: Path) -> None:
    """executorch's emitter serialises every `executorch_prim` result as an `Int(0)` placeholder that the kernel
    replaces: `truediv.Scalar` writes a double there. The check refused that (yolos: "truediv.Scalar on ['int',
    'int'] writes float into a int"); the runtime runs it."""
    from executorch.exir import to_edge_transform_and_lower

    from hfexport.artifacts import load

    model = _ScaleByLength().eval()
    x = torch.randn(2, 12, 4, generator=torch.Generator().manual_seed(2))
    shapes = {"x": {1: torch.export.Dim("n", min=4, max=64)}}
    program = torch.export.export(model, (), {"x": x}, dynamic_shapes=shapes)
    manager = to_edge_transform_and_lower(program).to_executorch()
    names = {op.name for op in deserialize_pte_binary(manager.buffer).program.execution_plan[0].operators}
    assert "executorch_prim::truediv" in names
    folder = save(manager, tmp_path / "artifact")
    check_pte(folder, {"main": "model.pte"})
    loaded = load(folder, trust=True)
    for length in (12, 29):
        feed = torch.randn(2, length, 4, generator=torch.Generator().manual_seed(length))
        (actual,) = loaded.run({"x": feed}).values()
        torch.testing.assert_close(actual, model(feed))
