"""tools/bench_peers.py's pure parts (`hfexport.apps.bench_peers`): rows chosen, arguments, token agreement and the
table (no peer is imported)."""

from __future__ import annotations

from types import ModuleType

import pytest

from hfexport.apps import bench_peers
from hfexport.apps.bench import token_agreement


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    return bench_peers


def test_default_rows_pair_each_hfexport_row_with_its_peer(bench: ModuleType) -> None:
    keys = [row.key for row in bench.select_rows(None)]
    assert keys[0] == "eager:fp32" and len(keys) == len(set(keys)) == 14
    for ours, theirs in (
        ("hfexport-onnx:int4", "onnxruntime-genai:int4"),
        ("hfexport-openvino:int4", "optimum-intel:int4"),
        ("hfexport-executorch:int4", "optimum-executorch:8da4w"),
    ):
        assert keys.index(theirs) == keys.index(ours) + 1


def test_a_row_selection_keeps_eager_and_the_build_a_row_runs(bench: ModuleType) -> None:
    keys = [row.key for row in bench.select_rows("optimum-intel:default,hfexport-onnx:int4")]
    # optimum-intel's default-hint row runs its fp32 row's artifact: that build comes along.
    assert keys == ["eager:fp32", "hfexport-onnx:int4", "optimum-intel:fp32", "optimum-intel:default"]
    assert [row.key for row in bench.select_rows("onnxruntime-genai")] == [
        "eager:fp32",
        "onnxruntime-genai:fp32",
        "onnxruntime-genai:int4",
    ]
    with pytest.raises(ValueError, match="row 'onnx-genai'"):
        bench.select_rows("onnx-genai")


def test_arguments(bench: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    args = bench.parse_args(["--layers", "2", "--shapes", "qwen2.5-0.5b", "--rows", "hfexport-executorch"])
    assert args.layers == 2 and args.shapes == ["qwen2.5-0.5b"] and args.rounds == 2 and args.new == 64
    assert [row.key for row in args.rows] == ["eager:fp32", "hfexport-executorch:fp32", "hfexport-executorch:int4"]
    assert bench.parse_args([]).shapes == ["smollm2-135m", "qwen2.5-0.5b"]
    for bad in (["--shapes", "gpt2"], ["--rows", "nope"], ["--rounds", "0"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
    assert "--shapes 'gpt2'" in capsys.readouterr().err


def test_token_agreement_counts_positions_and_the_common_prefix() -> None:
    eager = [5, 5, 5, 7, 7, 7]
    assert token_agreement(eager, eager) == (6, 6)
    # A row that repeats eager's later token from the start: 3 positions equal, none before the first difference.
    assert token_agreement([7] * 6, eager) == (3, 0)
    assert token_agreement([5, 5, 9, 7, 7, 7], eager) == (5, 2)


def test_table_has_one_row_per_result_with_ratios_to_eager_and_the_ceiling(bench: ModuleType) -> None:
    eager = bench.RowResult("eager:fp32", "fp32", ttft_s=[0.3, 0.5], decode_tokens_per_s=[10.0, 20.0], tokens=[1, 2, 3])
    ours = bench.RowResult(
        "hfexport-onnx:int4",
        "int4",
        export_s=12.4,
        peak_rss_mb=800.2,
        disk_bytes=84_000_000,
        ttft_s=[0.2],
        decode_tokens_per_s=[60.0],
        tokens=[1, 9, 3],
    )
    failed = bench.RowResult("optimum-executorch:8da4w", "8da4w", note="build: exit 1: boom | bang")
    lines = bench.table([eager, ours, failed], ceiling=20.0, new=3).splitlines()
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    assert cells[0] == list(bench.COLUMNS) and len(cells) == 5
    assert cells[2] == ["eager:fp32", "400", "15.0", "75%", "1.00", "reference", "-", "-", "-", ""]
    # int4: the ceiling is 8x fp32's (32 / 4 bits): 60 / 160 tok/s.
    assert cells[3] == ["hfexport-onnx:int4", "200", "60.0", "38%", "4.00", "2/3, first 1", "12", "800", "84", ""]
    assert cells[4][:2] == ["optimum-executorch:8da4w", "nan"] and cells[4][-1] == "build: exit 1: boom / bang"
