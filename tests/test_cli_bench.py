"""`hfexport bench` (issue #19, goal 7): the table a user gets for a model on this machine; its shape and its
token check, not its timings (a loaded machine makes those meaningless in a test)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from hfexport.cli import main


def _rows(output: str) -> list[list[str]]:
    lines = [line for line in output.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in lines]


def test_bench_prints_eager_and_each_backend_with_equal_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    args = ["bench", "--model", "tiny-llama", "--backends", "dynamo", "--prompt", "6", "--new", "3"]
    code = main([*args, "--repeats", "1", "--bandwidth-mb", "8", "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0, printed
    header, *rows = _rows(printed)
    assert header[:4] == ["run", "precision", "TTFT ms", "decode tok/s"] and header[-1] == "note"
    assert [(r[0], r[1]) for r in rows] == [
        ("eager generate (dynamic cache)", "fp32"),
        ("hfexport dynamo (static cache)", "fp32"),
    ]
    # The exported components generate eager's greedy tokens, and the row was timed (nan: the two medians'
    # noise exceeded the tiny model's decode time, which a loaded machine can do).
    assert rows[1][header.index("tokens")] == "equal"
    rate = float(rows[1][header.index("decode tok/s")])
    assert math.isnan(rate) or rate > 0
    record = json.loads(out.read_text())
    assert record["prompt"] == 6 and record["new"] == 3 and record["ceiling_tokens_per_s"] > 0
    assert record["rows"][1]["tokens"] == "equal" and record["rows"][1]["export_s"] > 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--backends", "onxx"], "--backends onxx: choose from dynamo, onnx, executorch"),
        (["--precisions", "int3"], "--precisions int3: choose from fp32, int8, int4"),
        (["--new", "1"], "--new must be at least 2"),
    ],
)
def test_bench_refuses_a_wrong_choice_before_loading(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "--model", "tiny-llama", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_bench_executorch_int8_generates_eager_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    """ExecuTorch int8 (XNNPACKQuantizer, dynamic activations) through `export_for_generation`: it failed in the
    lowering ("Invalid partition, found dependency cycles") until executorch/quant-dynamic-chain-per-consumer."""
    args = ["bench", "--model", "tiny-llama", "--backends", "executorch", "--precisions", "int8"]
    code = main([*args, "--prompt", "6", "--new", "3", "--repeats", "1", "--bandwidth-mb", "8"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    header, *rows = _rows(printed)
    assert [(r[0], r[1]) for r in rows][1:] == [("hfexport executorch (static cache)", "int8")]
    assert rows[1][header.index("tokens")] == "equal", printed


def test_static_decode_variant_exports_a_dynamic_prefill_and_a_static_one_token_decode_at_batch_one() -> None:
    import torch

    from hfexport.apps.bench import generation_export

    two_rows = {"input_ids": torch.ones(2, 8, dtype=torch.long), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    config, configs, sample, multi_token = generation_export("executorch-static-decode", "int8", two_rows)
    assert not multi_token and set(configs) == {"prefill", "decode"}
    assert configs["prefill"].dynamic and not configs["decode"].dynamic
    assert configs["decode"].quantizer is config.quantizer is not None, "both graphs quantized alike"
    assert {name: tuple(value.shape) for name, value in sample.items()} == {
        "input_ids": (1, 8),
        "attention_mask": (1, 8),
    }
    # The plain backend: one dynamic multi-token decode graph on the two-row sample (the batch stays dynamic).
    config, configs, sample, multi_token = generation_export("executorch", "fp32", two_rows)
    assert multi_token and configs is config and config.dynamic and sample is two_rows


@pytest.mark.slow
def test_bench_executorch_static_decode_generates_eager_tokens(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "--model", "tiny-llama", "--backends", "executorch-static-decode"]
    code = main([*args, "--prompt", "6", "--new", "3", "--repeats", "1", "--bandwidth-mb", "8"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    header, *rows = _rows(printed)
    assert [(r[0], r[1]) for r in rows][1:] == [("hfexport executorch-static-decode (static cache)", "fp32")]
    assert rows[1][header.index("tokens")] == "equal", printed
