"""Seed contract: the decode graph of `export_for_generation` takes tensors and the cache only.

The seed (../shared/seeds/000, "Decode-loop inference examples") drives one multi-token decode graph over a
static cache: Dynamo calls `decode(input_ids=, attention_mask=, position_ids=, past_key_values=cache).logits`
on the loaded program, the cache taken from its own `example_inputs`; ExecuTorch binds
`[input_ids, attention_mask, position_ids, cache x N]` by index and reads logits at output N. Both loops here
are the seed's, run as written (CPU instead of CUDA, hfexport's `register_pytree_node`), against
`model.generate(do_sample=False)`.
"""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hfexport import DynamoConfig, DynamoExporter
from hfexport.tiny import get_tiny_model

MAX_CACHE = 24
PROMPT = [[3, 5, 7, 9, 11]]
NEW_TOKENS = 8

# The seed's Dynamo tab, adapted only in the import line and the device; the prompt, the number of steps and
# where the tokens go are the test's. The loop stops after NEW_TOKENS tokens instead of at max_cache_len.
_SEED_DYNAMO_LOOP = """
import sys
import copy
import torch
from transformers import StaticCache
from hfexport import register_pytree_node

register_pytree_node(StaticCache)
exported = torch.export.load(sys.argv[1])
decode = exported.module()

_, example_kwargs = exported.example_inputs
past_key_values = copy.deepcopy(example_kwargs["past_key_values"])
past_key_values.reset()

prompt_ids = torch.tensor(eval(sys.argv[2]))
prompt_len = prompt_ids.shape[1]
max_cache_len = int(sys.argv[3])
new_tokens = int(sys.argv[4])
tokens = []

def causal_mask(positions, cache_len):   # [1, 1, len(positions), cache_len]
    return (torch.arange(cache_len, device="cpu")[None, :] <= positions[:, None])[None, None]

# prefill: the whole prompt in one call
positions = torch.arange(prompt_len, device="cpu")
logits = decode(input_ids=prompt_ids, attention_mask=causal_mask(positions, max_cache_len),
                position_ids=positions[None], past_key_values=past_key_values).logits
next_token = logits[:, -1:].argmax(-1)
tokens.append(int(next_token))

# decode: query=1 buffers reused in place
input_ids = torch.empty((1, 1), dtype=torch.long, device="cpu")
position_ids = torch.empty((1, 1), dtype=torch.long, device="cpu")
attention_mask = torch.empty((1, 1, 1, max_cache_len), dtype=torch.bool, device="cpu")
slots = torch.arange(max_cache_len, device="cpu")
for position in range(prompt_len, prompt_len + new_tokens - 1):
    input_ids.copy_(next_token)
    position_ids.fill_(position)
    attention_mask[0, 0, 0].copy_(slots <= position)
    logits = decode(input_ids=input_ids, attention_mask=attention_mask,
                    position_ids=position_ids, past_key_values=past_key_values).logits
    next_token = logits[:, -1:].argmax(-1)
    tokens.append(int(next_token))
print("TOKENS", tokens)
"""


def _causal_mask(positions: torch.Tensor, cache_len: int) -> torch.Tensor:
    return (torch.arange(cache_len)[None, :] <= positions[:, None])[None, None]


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    return get_tiny_model("tiny-llama").build().eval()


@pytest.fixture(scope="module")
def reference(llama: torch.nn.Module) -> list[int]:
    ids = torch.tensor(PROMPT)
    with torch.no_grad():
        out = llama.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
    return out[0, ids.shape[1] :].tolist()


def _static(llama: torch.nn.Module) -> object:
    from transformers import GenerationConfig

    return GenerationConfig(cache_implementation="static", max_cache_len=MAX_CACHE, pad_token_id=0)


@pytest.fixture(scope="module")
def exported(llama: torch.nn.Module) -> tuple[DynamoExporter, dict]:
    exporter = DynamoExporter()
    components = exporter.export_for_generation(
        llama,
        {"input_ids": torch.tensor(PROMPT)},
        DynamoConfig(dynamic=True),
        generation_config=_static(llama),
        multi_token_decode=True,
    )
    return exporter, components


@pytest.fixture(scope="module")
def decode_program(exported: tuple[DynamoExporter, dict]) -> torch.export.ExportedProgram:
    return exported[1]["decode"]


def test_reports_name_the_model_class_and_the_spec_feeds_no_constants(exported: tuple[DynamoExporter, dict]) -> None:
    exporter, components = exported
    assert {r.model_class for r in exporter.reports.values()} == {"LlamaForCausalLM"}
    assert components.spec.cache_key == "past_key_values"
    for spec in components.spec.components.values():
        assert spec.constants == {}
        assert spec.inputs == ["input_ids", "attention_mask", "position_ids", "past_key_values"]


def test_a_spec_with_python_inputs_from_an_older_export_is_refused(exported: tuple[DynamoExporter, dict]) -> None:
    import dataclasses

    from hfexport.backends.dynamo.driver import DynamoDriver
    from hfexport.core.errors import InputError

    _, components = exported
    spec = copy.deepcopy(components.spec)
    spec.components["decode"] = dataclasses.replace(spec.components["decode"], constants={"use_cache": True})
    with pytest.raises(InputError, match=r"older hfexport; export again"):
        DynamoDriver(dict(components), spec, components.samples)


def test_decompose_gives_tensor_inputs_in_graph_order(llama: torch.nn.Module) -> None:
    from transformers import StaticCache

    from hfexport.frontends.generation import FixedArguments, decompose_for_generation

    components = decompose_for_generation(
        llama, {"input_ids": torch.tensor(PROMPT)}, generation_config=_static(llama), multi_token_decode=True
    )
    for name, (module, kwargs) in components.items():
        assert list(kwargs) == ["input_ids", "attention_mask", "position_ids", "past_key_values"], (name, kwargs)
        assert isinstance(kwargs["past_key_values"], StaticCache)
        assert isinstance(module, FixedArguments) and module.inner is llama
        assert type(module).__name__ == "LlamaForCausalLM", "reports and errors name the real model class"
        assert module.config is llama.config
        assert module.fixed["logits_to_keep"] == 0 and module.fixed["use_cache"] is True
        # The pair reproduces the step, returning every query position's logits.
        with torch.no_grad():
            got = module(**{**kwargs, "past_key_values": copy.deepcopy(kwargs["past_key_values"])}).logits
            expected = llama(input_ids=kwargs["input_ids"]).logits  # the prefill: an empty cache, no padding
        assert got.shape[1] == kwargs["input_ids"].shape[1]
        if name == "prefill":
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_decode_program_takes_tensors_and_the_cache_only(decode_program: torch.export.ExportedProgram) -> None:
    spec = decode_program.call_spec.in_spec
    kwargs_spec = spec.children_specs[1]
    assert list(kwargs_spec.context) == ["input_ids", "attention_mask", "position_ids", "past_key_values"]
    user = [s for s in decode_program.graph_signature.input_specs if s.kind.name == "USER_INPUT"]
    assert all(s.arg.__class__.__name__ == "TensorArgument" for s in user), user


def test_one_decode_graph_serves_prompt_and_continuation_at_every_position(
    decode_program: torch.export.ExportedProgram, llama: torch.nn.Module
) -> None:
    from transformers import StaticCache

    decode = decode_program.module()
    _, example = decode_program.example_inputs
    cache = copy.deepcopy(example["past_key_values"])
    cache.reset()
    eager_cache = StaticCache(config=llama.config, max_cache_len=MAX_CACHE)
    prompt = torch.tensor(PROMPT)
    continuation = torch.tensor([[13, 2, 17]])
    start = 0
    for ids in (prompt, continuation):  # an empty cache, then a filled one; several query tokens each time
        positions = torch.arange(start, start + ids.shape[1])
        mask = _causal_mask(positions, MAX_CACHE)
        kwargs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions[None]}
        with torch.no_grad():
            got = decode(**kwargs, past_key_values=cache).logits
            expected = llama(**kwargs, past_key_values=eager_cache, use_cache=True).logits
        assert got.shape[1] == ids.shape[1]
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        start += ids.shape[1]
    assert cache.get_seq_length() == start, "module() updates the caller's cache in place"


def test_seed_dynamo_loop_on_a_saved_decode_program(
    decode_program: torch.export.ExportedProgram, reference: list[int], tmp_path: Path
) -> None:
    path = tmp_path / "decode.pt2"
    torch.export.save(decode_program, str(path))
    run = subprocess.run(
        [sys.executable, "-c", _SEED_DYNAMO_LOOP, str(path), repr(PROMPT), str(MAX_CACHE), str(NEW_TOKENS)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("TOKENS"))
    assert eval(line.removeprefix("TOKENS")) == reference


def test_seed_onnx_loop_with_a_plain_feed(llama: torch.nn.Module, reference: list[int]) -> None:
    # The seed's ONNX Runtime tab on CPU: CudaSession's shared buffers become a plain feed, the cache read back
    # from the `output.<name>` twin of each `input.<name>`; shapes and dtypes from the session alone.
    import numpy as np

    from hfexport import OnnxConfig, OnnxExporter

    components = OnnxExporter().export_for_generation(
        llama,
        {"input_ids": torch.tensor(PROMPT)},
        OnnxConfig(dynamic=True),
        generation_config=_static(llama),
        multi_token_decode=True,
    )
    import onnxruntime as ort

    session = ort.InferenceSession(components["decode"].model_proto.SerializeToString())
    names = [i.name for i in session.get_inputs()]
    assert names[:3] == ["input_ids", "attention_mask", "position_ids"]
    assert all(n.startswith("input.past_key_values.") for n in names[3:]) and names[3:]
    outputs = [o.name for o in session.get_outputs()]
    assert outputs == ["logits"] + ["output." + n.removeprefix("input.") for n in names[3:]]
    dtypes = {"tensor(float)": np.float32, "tensor(int64)": np.int64}
    cache = {}
    for i in session.get_inputs()[3:]:
        dims = [MAX_CACHE if isinstance(d, str) and not d.isdigit() else int(d) for d in i.shape]
        cache[i.name.removeprefix("input.")] = np.zeros(dims, dtype=dtypes[i.type])

    ids = torch.tensor(PROMPT)
    positions = torch.arange(ids.shape[1])
    tokens: list[int] = []
    for _ in range(NEW_TOKENS):
        feed = {
            "input_ids": ids.numpy(),
            "attention_mask": _causal_mask(positions, MAX_CACHE).numpy(),
            "position_ids": positions[None].numpy(),
            **{f"input.{name}": value for name, value in cache.items()},
        }
        out = dict(zip(outputs, session.run(None, feed), strict=True))
        cache = {name: out[f"output.{name}"] for name in cache}
        token = int(out["logits"][0, -1].argmax())
        tokens.append(token)
        ids, positions = torch.tensor([[token]]), positions[-1:] + 1
    assert tokens == reference


@pytest.mark.slow
def test_executorch_forward_binds_inputs_by_index_and_returns_the_cache(
    llama: torch.nn.Module, reference: list[int]
) -> None:
    pytest.importorskip("executorch")
    from hfexport import ExecutorchConfig, ExecutorchExporter
    from hfexport.runtime.executorch import _SCALAR_TYPES, ExecutorchProgram

    components = ExecutorchExporter().export_for_generation(
        llama,
        {"input_ids": torch.tensor(PROMPT)},
        ExecutorchConfig(backend="xnnpack", dynamic=True),
        generation_config=_static(llama),
        multi_token_decode=True,
    )
    method = ExecutorchProgram(components["decode"]).method
    meta = method.metadata
    n = meta.num_inputs() - 3
    assert n >= 2 * llama.config.num_hidden_layers, "K and V (and counters) per layer"
    # Every input is a tensor (input_tensor_meta raises for a bool / int / None input).
    infos = [meta.input_tensor_meta(index) for index in range(meta.num_inputs())]
    assert meta.num_outputs() == 2 * n + 1
    vocab = llama.config.vocab_size
    assert list(meta.output_tensor_meta(n).sizes())[-1] == vocab, "logits at index N"

    # The seed's ExecuTorch loop in Python: the cache bound by index, read back from the last N outputs.
    cache = []
    for info in infos[3:]:
        sizes = [int(s) for s in info.sizes()]  # upper bounds: the cache axis is max_cache_len at run time
        if len(sizes) == 4:
            sizes[2] = MAX_CACHE
        cache.append(torch.zeros(sizes, dtype=_SCALAR_TYPES[int(info.dtype())]))
    tokens: list[int] = []
    ids = torch.tensor(PROMPT)
    positions = torch.arange(ids.shape[1])
    for _ in range(NEW_TOKENS):
        outputs = method.execute([ids, _causal_mask(positions, MAX_CACHE), positions[None], *cache])
        logits, cache = outputs[n], [t.clone() for t in outputs[n + 1 :]]
        token = int(logits[0, -1].argmax())
        tokens.append(token)
        ids, positions = torch.tensor([[token]]), positions[-1:] + 1
    assert tokens == reference
