"""fx/split-symbolic-size-as-sizes: the rewritten graph takes the same slices as torch.split / torch.chunk at every
length (odd, even, a remainder, a single piece), a split on a static axis is left alone in a dynamic export, and
ProphetNet's n-gram streams (the cause) export to ONNX and match eager at other lengths."""

from __future__ import annotations

import importlib
import operator

import pytest
import torch

from hfexport.rewrites.engine import apply_rule
from hfexport.rewrites.examples import assert_same_outputs
from hfexport.rewrites.rule import RuleSelection
from hfexport.testing import harness
from hfexport.testing.harness import export_program

module = importlib.import_module("hfexport.rewrites.rules.fx.split_symbolic_size_as_sizes")
rule = module.split_symbolic_size_as_sizes
aten = torch.ops.aten


class _ChunkOfLength(torch.nn.Module):
    """x.chunk(chunks, dim=1) on a dynamic axis, every piece kept (their lengths show in the output)."""

    def __init__(self, chunks: int) -> None:
        super().__init__()
        self.chunks = chunks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pieces = x.chunk(self.chunks, dim=1)
        return torch.cat([p.sum(1, keepdim=True) * (i + 1) + p.shape[1] for i, p in enumerate(pieces)], dim=1)


def _splits(program: torch.export.ExportedProgram) -> dict[str, int]:
    names = {aten.split.Tensor: "split", aten.chunk.default: "chunk", aten.split_with_sizes.default: "with_sizes"}
    counts: dict[str, int] = {}
    for node in program.graph.nodes:
        if node.op == "call_function" and node.target in names:
            counts[names[node.target]] = counts.get(names[node.target], 0) + 1
    return counts


@pytest.mark.parametrize(
    ("chunks", "sample", "lengths"),
    [
        # Lengths the exported program accepts: its guards keep the sample's piece count, and a last piece of
        # one (0/1 specialisation) is refused by the program with or without the rule.
        (3, 9, (6, 8, 9, 12, 31)),  # three pieces: even, or the last one shorter (31: 11, 11, 9)
        (2, 7, (5, 7, 8, 13)),  # two pieces, the last one shorter at odd lengths
        (4, 8, (8, 12, 14, 16)),  # four pieces (14: 4, 4, 4, 2)
    ],
)
def test_the_rewritten_chunk_takes_torchs_slices_at_every_length(chunks: int, sample: int, lengths: tuple) -> None:
    model = _ChunkOfLength(chunks).eval()
    program = export_program(model, {"x": torch.randn(2, sample, 3)}, dynamic=True)
    assert _splits(program) == {"chunk": 1}
    assert apply_rule(rule, program).hits == 1
    assert _splits(program) == {"with_sizes": 1}
    rewritten = program.module()
    with torch.no_grad():
        for length in lengths:
            x = torch.randn(3, length, 3)
            assert_same_outputs(model(x=x), rewritten(x=x), 0.0, 0.0, f"{chunks} chunks of {length}")


def test_the_sizes_are_the_split_size_and_the_remainder() -> None:
    """`x.split(L // 2 + 1)`: sizes [s, L - s] with s the graph's own SymInt node (not a copy)."""
    model = module._Remainder().eval()
    program = export_program(model, module._x(length=7), dynamic=True)
    (split,) = [n for n in program.graph.nodes if n.target is aten.split.Tensor]
    x, size = split.args[0], split.args[1]
    assert apply_rule(rule, program).hits == 1
    (node,) = [n for n in program.graph.nodes if n.target is aten.split_with_sizes.default]
    first, last = node.args[1]
    assert first is size
    assert last.target is operator.sub
    assert str(last.meta["val"]) == str(x.meta["val"].shape[1] - size.meta["val"])
    with torch.no_grad():
        for length in (5, 6, 7, 10, 11):  # 4 (3 + 1) is refused by the program: a last piece of 1
            x = torch.randn(1, length, 4)
            assert_same_outputs(model(x=x), program.module()(x=x), 0.0, 0.0, f"{length} tokens")


@pytest.mark.slow
def test_a_chunk_of_a_static_axis_is_left_alone_in_a_dynamic_onnx_export() -> None:
    """A GLU gate chunked on the hidden axis (an int split size), batch and length dynamic: no hit, and eager's
    numbers at another length (the NoMatch examples are static exports, where nothing is symbolic)."""
    model = module._HiddenChunk().eval()
    inputs = module._x(length=6, seed=8)
    selection = RuleSelection(enable=(rule.id,), disable=("patch/", "fx/", "aten/", "onnx/"))
    exported = harness.export("onnx", model, inputs, selection, dynamic=True)
    assert exported.error is None, exported.error
    assert exported.hits(rule.id) == 0
    other = module._x(batch=3, length=11, seed=9)
    for feed in (inputs, other):
        got = [torch.as_tensor(a) for a in harness.run("onnx", exported.result, feed)]
        assert_same_outputs(harness.eager(model, feed), got, 1e-6, 1e-5)


def test_without_the_rule_the_optimizer_crashes_on_the_scalar_split() -> None:
    """The cause: onnxscript 0.7.2's SplitToSequence folding on a 0-d split of unknown value, in the graph
    torch.onnx's re-trace leaves (the translation without re-trace, which this program takes, keeps the split it
    can fold and exports eager's numbers without the rule)."""
    import onnx_ir as ir
    import onnxruntime as ort

    from hfexport.lowerings.onnx import newest_opset
    from hfexport.lowerings.onnx_optimizer import optimize
    from hfexport.lowerings.onnx_translate import translate

    model, inputs = module._Streams().eval(), module._x()
    retraced, _ = translate(export_program(model, inputs, dynamic=True), None, newest_opset(), retrace=True)
    with pytest.raises(Exception) as crash:
        optimize(retraced.model)
    text = f"{crash.value} {crash.value.__cause__}"
    assert "SplitToSequence" in text or "ndim" in text
    direct, skipped = translate(export_program(model, inputs, dynamic=True), None, newest_opset())
    assert skipped
    session = ort.InferenceSession(ir.to_proto(optimize(direct.model)).SerializeToString())
    for length in (7, 13):
        feed = module._x(length=length)
        got = [torch.as_tensor(a) for a in session.run(None, {k: v.numpy() for k, v in feed.items()})]
        assert_same_outputs(harness.eager(model, feed), got, 1e-6, 1e-5)
