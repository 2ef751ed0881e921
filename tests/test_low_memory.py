"""Low-memory ONNX export (`OnnxConfig(low_memory=True)`, docs/low-memory.md): capture on FakeTensor weights and
weights streamed from a sharded safetensors checkpoint, checked against the in-memory export and eager.

Every check runs the saved files in a real `onnxruntime.InferenceSession` (CPU).
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")

import onnx
import onnxruntime as ort
import transformers
from torch._subclasses.fake_tensor import FakeTensor

from hfexport import ConfigError, InputError, OnnxConfig, OnnxExporter, empty_model
from hfexport.artifacts.low_memory import check_streamed_weights
from hfexport.artifacts.reduced_depth import check_reduced_depth
from hfexport.core.checkpoints import Checkpoint
from hfexport.frontends.empty_weights import weight_sources
from hfexport.lowerings.onnx import STREAMED_KEY
from hfexport.naming import onnx_feed
from hfexport.tiny import TINY_MODELS

TINY = TINY_MODELS["tiny-llama"]


def _weights(path: Path) -> dict[str, bytes]:
    """{initializer name: its bytes} of a saved ONNX model, external data included."""
    proto = onnx.load(str(path), load_external_data=True)
    return {t.name: onnx.numpy_helper.to_array(t).tobytes() for t in proto.graph.initializer}


def _run(path: Path, inputs: dict[str, torch.Tensor]) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, onnx_feed([i.name for i in session.get_inputs()], inputs))[0]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny llama with tied embeddings, saved in several safetensors shards, and its in-memory export."""
    config = transformers.LlamaConfig(**TINY.config, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    folder = tmp_path_factory.mktemp("checkpoint")
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="20KB")
    inputs = TINY.sample_inputs()
    out = tmp_path_factory.mktemp("in-memory") / "model.onnx"
    OnnxExporter().export(model, inputs, OnnxConfig(dynamic=True, output_path=str(out)))
    return {"folder": folder, "model": model, "inputs": inputs, "in_memory": out}


@pytest.fixture(scope="module")
def streamed(checkpoint: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    empty = empty_model(checkpoint["folder"])
    out = tmp_path_factory.mktemp("low-memory") / "model.onnx"
    exporter = OnnxExporter()
    exporter.export(empty, checkpoint["inputs"], OnnxConfig(dynamic=True, low_memory=True, output_path=str(out)))
    return {"model": empty, "path": out, "report": exporter.report}


def test_the_fixture_checkpoint_is_sharded_and_tied(checkpoint: dict[str, Any]) -> None:
    shards = {info.shard for info in Checkpoint.open(checkpoint["folder"]).tensors.values()}
    assert len(shards) >= 2
    assert "lm_head.weight" not in Checkpoint.open(checkpoint["folder"])  # tied: saved once, as the embedding


def test_empty_model_has_fake_weights_and_real_rotary_buffers(checkpoint: dict[str, Any]) -> None:
    empty = empty_model(checkpoint["folder"])
    assert all(isinstance(p, FakeTensor) for p in empty.parameters())
    assert empty.lm_head.weight is empty.model.embed_tokens.weight  # still tied
    real_buffers = dict(checkpoint["model"].named_buffers())
    for name, buffer in empty.named_buffers():  # non-persistent: computed from the config, as from_pretrained does
        assert not isinstance(buffer, FakeTensor), name
        assert torch.equal(buffer, real_buffers[name]), name


def test_streamed_export_runs_like_the_in_memory_one_and_eager(
    checkpoint: dict[str, Any], streamed: dict[str, Any]
) -> None:
    inputs = checkpoint["inputs"]
    got = _run(streamed["path"], inputs)
    np.testing.assert_array_equal(got, _run(checkpoint["in_memory"], inputs))
    with torch.no_grad():
        expected = checkpoint["model"](**inputs).logits.numpy()
    assert np.abs(got - expected).max() <= 1e-4 * max(1.0, np.abs(expected).max())
    # Other shapes too: the capture on fake weights kept the axes dynamic.
    longer = TINY.sample_inputs(seed=1, batch=3, length=11)
    np.testing.assert_array_equal(_run(streamed["path"], longer), _run(checkpoint["in_memory"], longer))


def test_every_weight_is_written_with_the_in_memory_paths_bytes(
    checkpoint: dict[str, Any], streamed: dict[str, Any]
) -> None:
    ours, theirs = _weights(streamed["path"]), _weights(checkpoint["in_memory"])
    assert ours.keys() == theirs.keys()
    assert all(ours[name] == theirs[name] for name in ours), [n for n in ours if ours[n] != theirs[n]]
    # The tied weight is written once, and the .data files are the same size.
    assert not {"lm_head.weight", "model.embed_tokens.weight"} <= ours.keys()
    data = Path(f"{streamed['path']}.data").stat().st_size
    assert data == Path(f"{checkpoint['in_memory']}.data").stat().st_size


def test_streamed_weights_check_compares_with_the_checkpoint(
    checkpoint: dict[str, Any], streamed: dict[str, Any]
) -> None:
    source = Checkpoint.open(checkpoint["folder"])
    sources = weight_sources(streamed["model"], source)
    result = check_streamed_weights(streamed["path"], source)
    # Every external weight: those named after the checkpoint and the transposed (folded) linear weights.
    external = [
        t.name
        for t in onnx.load(str(streamed["path"]), load_external_data=False).graph.initializer
        if t.data_location == onnx.TensorProto.EXTERNAL
    ]
    assert result.ok and sorted(result.checked) == sorted(external) and len(external) >= 10
    # Bytes that are not the checkpoint tensor's (here: compared with its float16 cast) are found.
    name = result.checked[0]
    assert check_streamed_weights(streamed["path"], source, dtypes={name: torch.float16}).mismatched == [name]
    other = next(key for key in source.tensors if key != sources.get(name))
    assert check_streamed_weights(streamed["path"], source, {name: other}).mismatched == [name]


def test_dtype_is_applied_while_streaming(checkpoint: dict[str, Any], tmp_path: Path) -> None:
    """`dtype=float16`: the graph computes in fp16 and every weight is the checkpoint's fp32 tensor cast."""
    empty = empty_model(checkpoint["folder"], dtype=torch.float16)
    out = tmp_path / "model.onnx"
    OnnxExporter().export(empty, checkpoint["inputs"], OnnxConfig(low_memory=True, output_path=str(out)))
    source = Checkpoint.open(checkpoint["folder"])
    sources = weight_sources(empty, source)
    result = check_streamed_weights(out, source)
    assert result.ok and len(result.checked) >= 10, result
    proto = onnx.load(str(out), load_external_data=False)
    assert {t.data_type for t in proto.graph.initializer if t.name in sources} == {onnx.TensorProto.FLOAT16}
    with torch.no_grad():
        expected = checkpoint["model"].half()(**checkpoint["inputs"]).logits.float().numpy()
    checkpoint["model"].float()
    assert np.abs(_run(out, checkpoint["inputs"]).astype(np.float32) - expected).max() < 5e-2


@pytest.mark.parametrize("perm", [None, (1, 0)])
@pytest.mark.parametrize(
    ("stored", "graph"),
    [(torch.float32, torch.float32), (torch.float32, torch.float16), (torch.bfloat16, torch.float32)],
)
def test_weights_are_written_in_blocks_of_rows_with_the_whole_tensors_bytes(
    tmp_path: Path, perm: tuple[int, ...] | None, stored: torch.dtype, graph: torch.dtype
) -> None:
    """The save writes each streamed initializer a block of rows at a time (`write_rows`); blocks of 3 rows of
    an odd shape (37 x 11, the last block short), cast and transposed, give the bytes of the whole tensor's."""
    from safetensors.torch import save_file

    from hfexport.lowerings.onnx_weights import write_rows

    weight = (torch.randn(37, 11, generator=torch.Generator().manual_seed(0)) * 1e3).to(stored)
    # Another tensor in the shard, so that w's bytes do not start at the shard's first data byte.
    save_file({"w": weight, "b": torch.arange(5.0)}, str(tmp_path / "model.safetensors"))
    source = Checkpoint.open(tmp_path)
    expected = weight.to(graph)
    expected = expected.permute(perm).contiguous() if perm else expected
    file = io.BytesIO()
    file.write(b"head")  # the writer positions the file at the tensor's offset
    write_rows(file, source, "w", graph, perm, block_bytes=3 * 11 * 4)
    assert file.tell() == 4 + expected.numel() * graph.itemsize
    file.write(b"tail")
    assert file.getvalue() == b"head" + expected.view(torch.uint8).numpy().tobytes() + b"tail"
    with pytest.raises(ValueError, match="2-D"):
        write_rows(io.BytesIO(), source, "w", graph, (1, 0, 2))


def test_the_save_writes_external_weights_without_reading_them_whole(
    checkpoint: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The save writes every external weight in blocks of rows: once the export is done, `Checkpoint.load` (a
    whole tensor) is called only for the small weights stored inside model.onnx, and the saved weights are the
    in-memory path's."""
    program = OnnxExporter().export(
        empty_model(checkpoint["folder"]), checkpoint["inputs"], OnnxConfig(dynamic=True, low_memory=True)
    )
    assert program.exported_program is None  # the decomposed torch program was freed after translation
    loaded: list[str] = []
    load = Checkpoint.load

    def recording_load(self: Checkpoint, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        loaded.append(name)
        return load(self, name, dtype)

    monkeypatch.setattr(Checkpoint, "load", recording_load)
    out = tmp_path / "model.onnx"
    program.save(str(out), external_data=True)
    monkeypatch.undo()
    proto = onnx.load(str(out), load_external_data=False)
    record = json.loads(next(p.value for p in proto.metadata_props if p.key == STREAMED_KEY))
    # The checkpoint tensor of each external weight (folded transposes included: named after the Transpose).
    external = {record[t.name][0] for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL}
    assert len(external) >= 10 and not external & set(loaded), sorted(external & set(loaded))
    assert _weights(out) == _weights(checkpoint["in_memory"])


def test_reduced_depth_check_of_the_same_checkpoint(checkpoint: dict[str, Any]) -> None:
    result = check_reduced_depth(checkpoint["folder"], checkpoint["inputs"], OnnxConfig(dynamic=True), layers=1)
    assert result.ok, str(result.validation)
    assert result.to_dict()["reduced_depth_layers"] == 1


def test_fake_weights_are_refused_on_the_normal_path(checkpoint: dict[str, Any]) -> None:
    with pytest.raises(InputError, match=r"are FakeTensors .*OnnxConfig\(low_memory=True\)"):
        OnnxExporter().export(empty_model(checkpoint["folder"]), checkpoint["inputs"], OnnxConfig())


def test_low_memory_refusals(checkpoint: dict[str, Any], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="external_data must be True"):
        OnnxConfig(low_memory=True, external_data=False)
    with pytest.raises(ConfigError, match="set low_memory=True"):
        OnnxConfig(checkpoint=str(checkpoint["folder"]))
    empty = empty_model(checkpoint["folder"])
    empty.name_or_path = ""
    with pytest.raises(ConfigError, match="needs the checkpoint folder"):
        OnnxExporter().export(empty, checkpoint["inputs"], OnnxConfig(low_memory=True))
    with pytest.raises(InputError, match="holds no safetensors checkpoint"):
        OnnxExporter().export(empty, checkpoint["inputs"], OnnxConfig(low_memory=True, checkpoint=str(tmp_path)))
    with pytest.raises(InputError, match=r"on the meta device .*hfexport\.empty_model"):
        config = OnnxConfig(low_memory=True, checkpoint=str(checkpoint["folder"]))
        OnnxExporter().export(_meta_llama(), checkpoint["inputs"], config)
    untied = empty_model(checkpoint["folder"], tie_word_embeddings=False)
    with pytest.raises(InputError, match=r"'lm_head\.weight' of LlamaForCausalLM is not in the checkpoint"):
        OnnxExporter().export(untied, checkpoint["inputs"], OnnxConfig(low_memory=True))


def _meta_llama() -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY.config)).eval()


def _with_tokenizer(folder: Path) -> Path:
    """A word-level tokenizer beside the checkpoint, so the CLI builds sample inputs from the folder offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[PAD]": 0, "<s>": 1, "</s>": 2, "[UNK]": 3, "Hello": 4, ",": 5, "world": 6, "!": 7, "Export": 8, "me": 9}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]")
    fast.save_pretrained(folder)
    return folder


def test_cli_refuses_low_memory_where_it_cannot_stream(
    checkpoint: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hfexport.cli import main

    folder = str(checkpoint["folder"])
    for args, message in (
        (["--format", "dynamo", "--model", folder], "torch.export.save writes a .pt2"),
        (["--format", "executorch", "--model", folder], "ExecuTorch serialises a .pte"),
        (["--format", "onnx", "--model", "tiny-llama"], "streams weights from a checkpoint folder"),
        (["--format", "onnx", "--model", folder, "--generation"], "drop --generation"),
    ):
        assert main(["export", "--low-memory", "--output", str(tmp_path / "out"), *args]) == 2, args
        assert message in capsys.readouterr().err, args
    assert main(["export", "--model", folder, "--check-layers", "1", "--output", str(tmp_path / "out")]) == 2
    assert "--check-layers sets the reduced depth" in capsys.readouterr().err


def cli_low_memory_export(folder: Path, export_format: str, out: Path) -> None:
    """`hfexport export --low-memory --validate --check-layers 1` of `folder` in a subprocess: it succeeds, and
    the manifest records the reduced-depth check and every streamed weight equal to its checkpoint tensor."""
    import json
    import subprocess
    import sys

    command = [sys.executable, "-m", "hfexport", "export", "--model", str(folder), "--format", export_format]
    command += ["--low-memory", "--validate", "--check-layers", "1", "--output", str(out)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]
    validation = json.loads((out / "manifest.json").read_text())["validation"]
    assert validation["ok"] and validation["reduced_depth_layers"] == 1
    assert validation["streamed_weights"]["checked"] >= 10 and not validation["streamed_weights"]["mismatched"]


@pytest.mark.slow
def test_cli_low_memory_export_and_validation(checkpoint: dict[str, Any], tmp_path: Path) -> None:
    import subprocess
    import sys

    out = tmp_path / "out"
    cli_low_memory_export(_with_tokenizer(checkpoint["folder"]), "onnx", out)
    check = subprocess.run([sys.executable, "-m", "hfexport", "check", str(out)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_default_path_streams_a_checkpoint_larger_than_half_the_available_memory(
    checkpoint: dict[str, Any], tmp_path: Path
) -> None:
    from hfexport.core.checkpoints import available_memory, low_memory_reason

    size = Checkpoint.open(checkpoint["folder"]).nbytes
    reason = low_memory_reason(checkpoint["folder"], available=int(size * 1.5))
    assert reason is not None and "take more than 50% of the available memory" in reason
    assert low_memory_reason(checkpoint["folder"], available=size * 3) is None
    assert low_memory_reason(tmp_path, available=1) is None  # no safetensors checkpoint: nothing to stream
    # On this machine the tiny checkpoint fits: the CLI's default keeps loading it.
    assert available_memory() and low_memory_reason(checkpoint["folder"]) is None


def test_checkpoint_keys_transformers_renames_at_load_are_streamed(checkpoint: dict[str, Any], tmp_path: Path) -> None:
    """A checkpoint saved from the base model (keys without the `model.` prefix, as `LlamaModel.save_pretrained`
    writes them): mapped the way `from_pretrained` maps them, and streamed with the in-memory path's bytes."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = tmp_path / "renamed"
    folder.mkdir()
    shutil.copy(checkpoint["folder"] / "config.json", folder)
    tensors = {}
    for shard in sorted(checkpoint["folder"].glob("*.safetensors")):
        tensors.update(load_file(shard))
    save_file({k.removeprefix("model."): v for k, v in tensors.items()}, folder / "model.safetensors")
    empty = empty_model(folder)
    sources = weight_sources(empty, Checkpoint.open(folder))
    assert sources["model.layers.0.self_attn.q_proj.weight"] == "layers.0.self_attn.q_proj.weight"
    assert sources["lm_head.weight"] == sources["model.embed_tokens.weight"] == "embed_tokens.weight"
    out = tmp_path / "out" / "model.onnx"
    OnnxExporter().export(empty, checkpoint["inputs"], OnnxConfig(dynamic=True, low_memory=True, output_path=str(out)))
    assert _weights(out) == _weights(checkpoint["in_memory"])


def test_a_conversion_that_is_not_a_rename_is_refused_naming_it(tmp_path: Path) -> None:
    """Qwen3-MoE checkpoints hold one tensor per expert; transformers stacks them at load (MergeModulelist)."""
    TINY_MODELS["tiny-qwen3-moe"].build().save_pretrained(tmp_path)
    empty = empty_model(tmp_path)
    with pytest.raises(InputError, match=r"'model\.layers\.0\.mlp\.experts\.\w+' .* by MergeModulelist"):
        weight_sources(empty, Checkpoint.open(tmp_path))
