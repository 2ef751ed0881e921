"""DynamoExporter parity on tiny random models of real architectures (tests/fixtures/corpus).

Every architecture is exported once with `dynamic=True`; the program must match eager on the sample
inputs and on the shapes that find baked lengths (`CorpusEntry.shape_inputs`: grown, 73 and 138 tokens
across windows and chunks, another batch size). A representative set runs by default; the whole causal-LM corpus
runs with `-m slow` (and as `hfexport sweep`).
"""

from __future__ import annotations

import pytest
import torch

from hfexport import DynamoConfig, DynamoExporter
from hfexport.testing.corpus import CorpusEntry, load_corpus
from hfexport.testing.corpus_check import check_entry, failures

# One per family of export problems: plain decoders, learned/ALiBi positions, MoE, MLA, SSM and hybrids,
# sliding windows and soft-capping, conv layers.
FAST = {
    "llama",
    "gpt2",
    "opt",
    "gpt_neo",
    "qwen3_moe",
    "mixtral",
    "gpt_oss",
    "deepseek_v3",
    "gemma2",
    "falcon_mamba",
    "lfm2",
    "granitemoehybrid",
    "cpmant",
    "olmoe",
    "starcoder2",
}

# Known gaps, each with its cause; strict, so a fix shows up as a failure to remove the entry.
KNOWN_FAILURES = {
    "deepseek_v4": "shape-dependent branches in DeepseekV4 attention (modeling_deepseek_v4.py:424) pin the length",
}

CAUSAL_LM = load_corpus(family="causal_lm")


def _marks(model_type: str) -> list:
    marks = [] if model_type in FAST else [pytest.mark.slow]
    if model_type in KNOWN_FAILURES:
        marks.append(pytest.mark.xfail(reason=KNOWN_FAILURES[model_type], strict=True))
    return marks


def _params() -> list:
    return [pytest.param(entry, id=entry.model_type, marks=_marks(entry.model_type)) for entry in CAUSAL_LM]


def _assert_parity(expected: torch.Tensor, actual: torch.Tensor, what: str) -> None:
    tolerance = 1e-4 * max(1.0, expected.abs().max().item())
    diff = (expected - actual).abs().max().item()
    assert diff <= tolerance, f"{what}: max abs diff {diff:.3g} > {tolerance:.3g}"


@pytest.mark.parametrize("entry", _params())
@pytest.mark.slow
def test_dynamo_matches_eager_on_other_shapes(entry: CorpusEntry) -> None:
    model = entry.build_model()
    exporter = DynamoExporter()
    program = exporter.export(model, entry.sample_inputs(), DynamoConfig(dynamic=True))
    module = program.module()
    checks = check_entry(entry, model, lambda feed: module(**feed), tolerance=1e-4)
    assert [c.name for c in checks if not c.skipped][:2] == ["sample", "grown"]
    assert not failures(checks), f"{entry.model_type}: " + " | ".join(failures(checks))
    # the report names every rule that fired, with positive counts only
    assert all(count > 0 for stage in exporter.report.hits.values() for count in stage.values())


# Chunked / recurrent sequence mixers: lengths across several chunks and exact multiples of the chunk size,
# which the +5-token grown input never reaches.
LONG = {
    "falcon_mamba": (21, 32),
    "granitemoehybrid": (35, 32),
    "bamba": (35, 16),
    "falcon_h1": (35, 16),
    "nemotron_h": (131, 64),
    "qwen3_next": (131, 64),
}


@pytest.mark.parametrize(
    "entry",
    [
        pytest.param(e, id=e.model_type, marks=() if e.model_type in FAST else pytest.mark.slow)
        for e in CAUSAL_LM
        if e.model_type in LONG
    ],
)
def test_chunked_sequence_mixers_accept_lengths_across_chunks(entry: CorpusEntry) -> None:
    model = entry.build_model()
    program = DynamoExporter().export(model, entry.sample_inputs(), DynamoConfig(dynamic=True))
    low, high = entry.sample["text_range"]
    generator = torch.Generator().manual_seed(0)
    for length in LONG[entry.model_type]:
        ids = torch.randint(max(low, 3), high, (2, length), generator=generator)
        feed = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        with torch.no_grad():
            expected = entry.main_output(model(**feed))
        _assert_parity(expected, entry.main_output(program.module()(**feed)), f"length {length}")
