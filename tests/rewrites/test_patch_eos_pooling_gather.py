"""patch/eos-pooling-gather: without it the BART-style classifier's program does not load; with it the head's
own checks still refuse a batch whose rows have different EOS counts; the scan and the rule agree on the classes.
(The examples, run in tests/rewrites/test_examples.py, compare the backends with eager.)"""

from __future__ import annotations

import io

import pytest
import torch

from hfexport import DynamoConfig, DynamoExporter, RuleSelection
from hfexport.rewrites.rules.patch.eos_pooling_gather import eos_pooling_gather as rule


def _export(disable: tuple[str, ...] = ()) -> tuple[torch.export.ExportedProgram, torch.nn.Module, dict]:
    model, inputs = rule.meta.examples[0].build()
    exporter = DynamoExporter()
    program = exporter.export(model, inputs, config=DynamoConfig(dynamic=True, rules=RuleSelection(disable=disable)))
    return program, model, inputs


def _reload(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    buffer.seek(0)
    return torch.export.load(buffer)


def test_without_the_rule_the_saved_program_does_not_load() -> None:
    program, _, _ = _export(disable=(rule.meta.id,))
    with pytest.raises(AssertionError, match="unbacked symbols"):
        _reload(program)


def test_with_the_rule_the_reloaded_program_matches_eager_and_keeps_the_count_check() -> None:
    program, model, inputs = _export()
    loaded = _reload(program).module()
    with torch.no_grad():
        expected = model(**inputs).logits
    torch.testing.assert_close(loaded(**inputs)[0], expected, rtol=1e-5, atol=1e-5)
    uneven = dict(inputs, input_ids=inputs["input_ids"].clone())
    uneven["input_ids"][0, 2] = 9  # row 0 keeps one EOS, row 1 two
    with pytest.raises(ValueError, match="same number of <eos> tokens"):
        model(**uneven)  # eager, unpatched: the head's check
    with pytest.raises(RuntimeError):
        loaded(**uneven)  # the program: the same condition as a runtime assertion


@pytest.mark.slow  # parses ten modeling files (about 30 s on the shared machine)
def test_the_rule_binds_to_every_class_the_scan_lists() -> None:
    import transformers

    from hfexport.apps.scan import scan

    models = ["bart", "mbart", "plbart", "mvp", "bigbird_pegasus", "t5", "mt5", "umt5", "led", "pegasus"]
    sites = [s for s in scan(models=models).sites if s.kind == "mask-row-pooling"]
    owners = {s.owner for s in sites}
    assert owners == {
        "BartForSequenceClassification",
        "MBartForSequenceClassification",
        "PLBartForSequenceClassification",
        "MvpForSequenceClassification",
        "BigBirdPegasusForSequenceClassification",
        "T5ForSequenceClassification",
        "MT5ForSequenceClassification",
        "UMT5ForSequenceClassification",
    }, owners
    assert all(s.rules == (rule.meta.id,) for s in sites)
    bart = transformers.BartForSequenceClassification(transformers.BartConfig(d_model=16, encoder_layers=1))
    assert rule.target(bart) and not rule.target(bart.model)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_helpers_equal_the_original_expressions_whenever_the_checks_hold(dtype: torch.dtype) -> None:
    from hfexport.rewrites.rules.patch.eos_pooling_gather import last_true_rows, same_count

    generator = torch.Generator().manual_seed(0)
    for batch, length, hidden, count in [(1, 1, 3, 1), (2, 7, 5, 1), (3, 9, 4, 3), (4, 6, 1, 6)]:
        x = torch.randn(batch, length, hidden, generator=generator).to(dtype)
        mask = torch.zeros(batch, length, dtype=torch.bool)
        for row in range(batch):
            mask[row, torch.randperm(length, generator=generator)[:count]] = True
        original = x[mask, :].view(batch, -1, hidden)[:, -1, :]
        assert torch.equal(last_true_rows(x, mask).view(batch, -1, hidden)[:, -1, :], original)
        assert bool(same_count(mask.sum(1))) == (torch.unique_consecutive(mask.sum(1)).numel() == 1)
    uneven = torch.tensor([[True, False, True], [False, False, True]])
    assert not same_count(uneven.sum(1)) and not same_count(torch.zeros(0, dtype=torch.long))
    with pytest.raises(ValueError, match="at least one <eos>"):
        last_true_rows(torch.randn(2, 3, 4), torch.tensor([[True, False, False], [False, False, False]]))
    # Not a [B, L] boolean mask of a [B, L, H] tensor: the original indexing, unchanged.
    index = torch.tensor([0, 2])
    assert torch.equal(last_true_rows(torch.arange(12.0).view(3, 4), index), torch.arange(12.0).view(3, 4)[index, :])
