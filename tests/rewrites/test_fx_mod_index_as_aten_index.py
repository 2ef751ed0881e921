"""fx/mod-index-as-aten-index: what it is needed for. torch.export.save refuses each Match example's program without
it (a flat_apply of torch._dynamo's ModIndex inside transformers' vmapped mask); with it the program saves, loads,
and the loaded program equals eager exactly, at other lengths, batches and paddings than the traced ones."""

from __future__ import annotations

import importlib
import io
from pathlib import Path

import pytest
import torch

from hfexport.rewrites.engine import apply_rule
from hfexport.rewrites.examples import Match, assert_same_outputs
from hfexport.testing.harness import export_program, leaves

# The rule package re-exports the rule under its module's name, so the module is imported by path.
module = importlib.import_module("hfexport.rewrites.rules.fx.mod_index_as_aten_index")
rule = module.mod_index_as_aten_index
CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "corpus_all"


def _round_trip(program: torch.export.ExportedProgram) -> torch.nn.Module:
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    return torch.export.load(buffer).module()


def _flat_applies(program: torch.export.ExportedProgram) -> int:
    return sum(n.target is torch.ops.higher_order.flat_apply for n in program.graph.nodes)


def _padded(batch: int, length: int, seed: int) -> torch.Tensor:
    """Random left and right padding, one row fully padded when there are three or more."""
    generator = torch.Generator().manual_seed(seed)
    mask = torch.ones(batch, length, dtype=torch.int64)
    for row in range(batch):
        left, right = torch.randint(0, max(1, length // 2), (2,), generator=generator).tolist()
        mask[row, :left] = 0
        mask[row, length - right :] = 0
    if batch >= 3:
        mask[2] = 0
    return mask


@pytest.mark.parametrize("index", [i for i, e in enumerate(rule.meta.examples) if isinstance(e, Match)])
def test_the_match_cannot_be_saved_without_the_rule_and_matches_eager_after_a_round_trip(index: int) -> None:
    example = rule.meta.examples[index]
    model, inputs = example.build()
    model.eval()
    program = export_program(model, inputs, dynamic=True)
    sites = _flat_applies(program)
    assert sites >= 1
    with pytest.raises(Exception, match="flat_apply"):
        torch.export.save(program, io.BytesIO())
    assert apply_rule(rule, program).hits == sites
    assert _flat_applies(program) == 0
    loaded = _round_trip(program)
    feeds = [inputs, example.other_inputs()]
    for seed, (batch, length) in enumerate([(1, 1), (2, 5), (3, 8), (4, 13)]):
        scores = torch.randn(batch, 2, length, length, generator=torch.Generator().manual_seed(seed))
        feeds.append({"scores": scores, "attention_mask": _padded(batch, length, seed)})
    with torch.no_grad():
        for feed in feeds:
            assert_same_outputs(model(**feed), loaded(**feed), 0.0, 0.0, rule.id)


@pytest.mark.slow
def test_t5gemma2_saves_and_matches_eager_with_padding() -> None:
    """The corpus T5Gemma2 encoder (its sliding-window mask is the vmapped one): saved, loaded, and equal to eager
    at other lengths and batches with padded rows (about 30 s; the seq2seq entry is the sweep's)."""
    from hfexport.frontends.torch_export import auto_dynamic_shapes
    from hfexport.testing.corpus import load_entry

    entry = load_entry(CORPUS / "encoder" / "t5gemma2.json")
    torch.manual_seed(0)
    model = entry.build_model().eval()
    inputs = entry.sample_inputs()
    with torch.no_grad():
        program = torch.export.export(model, (), dict(inputs), dynamic_shapes=auto_dynamic_shapes(inputs), strict=False)
    assert apply_rule(rule, program).hits >= 1
    loaded = _round_trip(program)
    vocab = int(inputs["input_ids"].max()) + 1
    with torch.no_grad():
        for seed, (batch, length) in enumerate([(2, 13), (3, 5)]):
            feed = dict(inputs)
            for name, value in inputs.items():
                if isinstance(value, torch.Tensor) and value.ndim == 2:
                    ids = torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))
                    feed[name] = _padded(batch, length, seed) if "mask" in name else ids
            assert_same_outputs(leaves(model(**feed)), leaves(loaded(**feed)), 1e-5, 1e-5, rule.id)
