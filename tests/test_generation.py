"""Generation: components found by decompose_for_generation, export_for_generation, and generate() on every
backend with exactly the greedy tokens of `model.generate`.

Tiny random models from config; prompts are left-padded so masks matter.
"""

from __future__ import annotations

import copy
import gc
import json
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import GenerationConfig

import hfexport
from hfexport import (
    AutoExportConfig,
    AutoHfExporter,
    DynamoConfig,
    DynamoExporter,
    ExecutorchConfig,
    ExecutorchExporter,
    OnnxConfig,
    OnnxExporter,
    OpenVINOConfig,
    OpenVINOExporter,
)
from hfexport.formats import MAIN_FILE
from hfexport.frontends.generation import decompose_for_generation
from hfexport.runtime.generation import generate
from hfexport.tiny import get_tiny_model

MAX_CACHE = 32
NEW_TOKENS = 6


def _static() -> GenerationConfig:
    return GenerationConfig(cache_implementation="static", max_cache_len=MAX_CACHE)


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    return get_tiny_model("tiny-llama").build()


def _sample(batch: int = 2, length: int = 5, seed: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids}


def _padded_prompt() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 0
    return ids, mask


def _reference(model: torch.nn.Module, static: bool) -> torch.Tensor:
    ids, mask = _padded_prompt()
    extra = {"generation_config": _static()} if static else {}
    config = extra.get("generation_config") or GenerationConfig()
    config.max_new_tokens = config.min_new_tokens = NEW_TOKENS
    config.do_sample = False
    config.pad_token_id = 0
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, generation_config=config)


# -- decomposition ---------------------------------------------------------------------------------------


def _names(model_name: str, **kwargs: object) -> dict[str, tuple[str, list[str]]]:
    tiny = get_tiny_model(model_name)
    inputs = tiny.sample_inputs()
    inputs.pop("decoder_input_ids", None)
    components = decompose_for_generation(tiny.build(), inputs, **kwargs)
    return {name: (type(module).__name__, sorted(kw)) for name, (module, kw) in components.items()}


def test_decoder_only_components_take_a_mask_even_when_the_sample_has_none(llama: torch.nn.Module) -> None:
    components = decompose_for_generation(llama, _sample())
    assert list(components) == ["prefill", "decode"]
    prefill, decode = components["prefill"][1], components["decode"][1]
    # generate drops an all-ones mask; the components must still take one.
    assert prefill["attention_mask"].shape == (2, 5)
    assert decode["attention_mask"].shape == (2, 6)
    assert decode["input_ids"].shape == (2, 1)
    assert decode["past_key_values"].get_seq_length() == 5


def test_multi_token_decode_merges_two_steps(llama: torch.nn.Module) -> None:
    components = decompose_for_generation(llama, _sample(), generation_config=_static(), multi_token_decode=True)
    module, decode = components["decode"]
    assert list(decode) == ["input_ids", "attention_mask", "position_ids", "past_key_values"]
    assert decode["input_ids"].shape == (2, 2)
    assert decode["attention_mask"].shape == (2, 1, 2, MAX_CACHE)
    assert module.fixed == {"logits_to_keep": 0, "use_cache": True, "return_dict": True}
    assert int(decode["past_key_values"].layers[0].cumulative_length) == 5
    # The merged call reproduces the two steps it replaces.
    model_kwargs = copy.deepcopy(decode)
    with torch.no_grad():
        merged = module(**model_kwargs).logits
    assert merged.shape[:2] == (2, 2)
    # The prefill sample is an allocated, empty static cache.
    prefill_cache = components["prefill"][1]["past_key_values"]
    assert int(prefill_cache.layers[0].cumulative_length) == 0
    assert prefill_cache.layers[0].keys.shape[2] == MAX_CACHE


@pytest.mark.parametrize(
    ("model_name", "expected"),
    [
        ("tiny-qwen3-moe", ["prefill", "decode"]),
        ("tiny-mamba", ["prefill", "decode"]),
        ("tiny-t5", ["encoder", "prefill", "decode"]),
        ("tiny-whisper", ["encoder", "prefill", "decode"]),
        (
            "tiny-llava",
            ["image_encoder", "multi_modal_projector", "language_model", "lm_head", "decode"],
        ),
    ],
)
def test_component_names(model_name: str, expected: list[str]) -> None:
    # The documented components only; what hfexport's own generate() runs besides is on `.runtime`.
    names = _names(model_name)
    assert list(names) == expected
    tiny = get_tiny_model(model_name)
    inputs = {k: v for k, v in tiny.sample_inputs().items() if k != "decoder_input_ids"}
    runtime = decompose_for_generation(tiny.build(), inputs).runtime
    assert list(runtime) == (["image_features", "prefill"] if "language_model" in names else [])
    if "encoder" in names:
        assert names["prefill"][1].count("encoder_outputs") == 1
    if "language_model" in names:
        assert "inputs_embeds" in names["language_model"][1]
        assert "attention_mask" in names["language_model"][1]
        assert names["decode"][1].count("input_ids") == 1


def tiny_qwen2_vl() -> torch.nn.Module:
    """A Qwen2-VL (multimodal rotary positions, no projector) small enough for unit tests."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    text = {
        "vocab_size": 160,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
        "max_position_embeddings": 256,
    }
    vision = {"depth": 2, "embed_dim": 32, "hidden_size": 32, "num_heads": 4, "mlp_ratio": 2, "patch_size": 4}
    config = Qwen2VLConfig(
        text_config=text,
        vision_config={**vision, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_chans": 3},
        image_token_id=151,
        video_token_id=152,
        vision_start_token_id=153,
        vision_end_token_id=154,
        pad_token_id=0,
        eos_token_id=2,
        bos_token_id=1,
    )
    torch.manual_seed(0)
    return Qwen2VLForConditionalGeneration(config).eval()


def test_vision_model_without_projector() -> None:
    model = tiny_qwen2_vl()
    # One 8x8 image as 4x4 patches of 4x4 pixels (2 frames), merged 2x2: 4 image tokens.
    ids = torch.cat([torch.tensor([[5, 153]]), torch.full((1, 4), 151), torch.tensor([[154, 7, 8]])], 1)
    inputs = {"input_ids": ids, "pixel_values": torch.randn(16, 96), "image_grid_thw": torch.tensor([[1, 4, 4]])}
    components = decompose_for_generation(model, inputs)
    assert list(components) == ["image_encoder", "language_model", "lm_head", "decode"]
    assert list(components.runtime) == ["image_features", "prefill"]
    # The grid is a layout, baked into the tower: the pixels are the encoder's only input.
    assert sorted(k for k, v in components["image_encoder"][1].items() if torch.is_tensor(v)) == ["hidden_states"]
    assert components.layouts["image_encoder"] == {"grid_thw": [[1, 4, 4]]}


def test_config_dict_must_name_every_component(llama: torch.nn.Module) -> None:
    exporter = DynamoExporter()
    with pytest.raises(ValueError, match=r"missing \['decode'\]"):
        exporter.export_for_generation(llama, _sample(), {"prefill": DynamoConfig()})
    assert exporter.report is None  # nothing was traced


# -- export + generate on every backend ----------------------------------------------------------------------

BACKENDS = {
    "dynamo": (DynamoExporter, DynamoConfig),
    "onnx": (OnnxExporter, OnnxConfig),
    "openvino": (OpenVINOExporter, OpenVINOConfig),
    "executorch": (ExecutorchExporter, ExecutorchConfig),
}


# ExecuTorch's lowering takes a minute (`Backend.slow_lowering`): its static exports run in the slow tier.
@pytest.fixture(
    scope="module", params=[b if b != "executorch" else pytest.param(b, marks=pytest.mark.slow) for b in BACKENDS]
)
def static_export(request: pytest.FixtureRequest, llama: torch.nn.Module) -> tuple[str, dict]:
    exporter_class, config_class = BACKENDS[request.param]
    components = exporter_class().export_for_generation(
        llama, _sample(), config_class(dynamic=True), generation_config=_static(), multi_token_decode=True
    )
    return request.param, components


@pytest.mark.slow
def test_static_single_graph_generate_matches_generate(static_export: tuple[str, dict], llama) -> None:
    backend, components = static_export
    ids, mask = _padded_prompt()
    expected = _reference(llama, static=True)
    attributes = dict(vars(components))
    drivers: set[int] = set()

    def record(driver) -> None:
        drivers.add(id(driver))

    # The decode graph alone: the whole prompt on an empty cache, then one token a step.
    got = generate(components, ids, mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, on_step=record)
    assert torch.equal(got, expected), backend
    # The cache length is symbolic: a longer cache at run time gives the same tokens.
    longer = generate(
        components, ids, mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, max_cache_len=48, on_step=record
    )
    assert torch.equal(longer, expected), backend
    # One driver for both calls (sessions and compiled models are reused), kept by the runtime, not on the object.
    assert len(drivers) == 1
    assert vars(components).keys() == attributes.keys() and all(vars(components)[k] is v for k, v in attributes.items())


@pytest.mark.parametrize("backend", ["dynamo", "onnx"])
@pytest.mark.slow
def test_dynamic_cache_pair_generate_matches_generate(backend: str, llama: torch.nn.Module, tmp_path) -> None:
    exporter_class, config_class = BACKENDS[backend]
    components = exporter_class().export_for_generation(llama, _sample(), config_class(dynamic=True))
    ids, mask = _padded_prompt()
    got = generate(components, ids, mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    assert torch.equal(got, _reference(llama, static=False))
    # A saved artifact drives the same loop from its manifest alone (a growing cache: prefill + decode).
    loaded = hfexport.load(hfexport.save(components, tmp_path / "gen"), trust=True)
    fields = dict(vars(loaded))
    assert torch.equal(generate(loaded, ids, mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS), got)
    assert vars(loaded).keys() == fields.keys(), "generate writes nothing onto the loaded export"
    # The runtime's driver of an object lives as long as the object, no longer.
    drivers: list[weakref.ref] = []
    generate(components, ids, mask, max_new_tokens=2, on_step=lambda d: drivers.append(weakref.ref(d)))
    assert drivers and drivers[0]() is not None
    del components
    gc.collect()
    assert drivers[0]() is None, "the driver outlived its components"


def test_loaded_artifact_generates_like_the_export(static_export: tuple[str, dict], llama, tmp_path) -> None:
    backend, components = static_export
    loaded = hfexport.load(hfexport.save(components, tmp_path / backend), trust=True)
    manifest = json.loads((tmp_path / backend / "manifest.json").read_text())
    assert manifest["generation"]["static_cache"] is True  # the layout is plain data in the manifest
    # The prefill is the decode program: stored once (its files are decode's), opened once.
    prefill, decode = manifest["components"]["prefill"], manifest["components"]["decode"]
    assert prefill["main"] == decode["main"] == f"decode/{MAIN_FILE[backend]}"
    model_files = [f for f in decode["files"] if not f.endswith("report.json")]
    assert model_files == [f for f in prefill["files"] if not f.endswith("report.json")]
    assert not [f for f in manifest["files"] if f.startswith("prefill/") and not f.endswith("report.json")]
    assert loaded["prefill"].runtime is loaded["decode"].runtime is not None
    ids, mask = _padded_prompt()
    expected = _reference(llama, static=True)
    drivers: list[Any] = []
    got = generate(loaded, ids, mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, on_step=drivers.append)
    assert torch.equal(got, expected), backend
    opened = {"dynamo": "modules", "onnx": "sessions", "openvino": "runners", "executorch": "programs"}[backend]
    assert getattr(drivers[0], opened)["prefill"] is getattr(drivers[0], opened)["decode"], backend
    longer = generate(loaded, ids, mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, max_cache_len=48)
    assert torch.equal(longer, expected), backend


def test_static_decode_graph_takes_any_query_length(static_export: tuple[str, dict], llama) -> None:
    backend, components = static_export
    if backend != "dynamo":
        pytest.skip("query lengths are checked on the ExportedProgram; the runtimes run the same graph")
    from transformers import StaticCache

    decode = components["decode"].module()
    for query in (1, 3, 9):
        cache = StaticCache(config=llama.config, max_cache_len=MAX_CACHE)
        cache.early_initialization(1, 2, 8, torch.float32, "cpu")
        reference_cache = copy.deepcopy(cache)
        positions = torch.arange(query)[None]
        mask = torch.arange(MAX_CACHE)[None, None, None, :] <= positions[:, None, :, None]
        ids = torch.randint(3, 128, (1, query), generator=torch.Generator().manual_seed(query))
        kwargs = {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
        got = decode(**kwargs, past_key_values=cache).logits
        with torch.no_grad():
            want = llama(**kwargs, cache=reference_cache, use_cache=True).logits
        assert got.shape == (1, query, 128)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert int(cache.layers[0].cumulative_length) == query  # written in place


def test_dynamo_cache_write_is_an_input_mutation_and_survives_save_load(static_export, llama, tmp_path) -> None:
    backend, components = static_export
    if backend != "dynamo":
        pytest.skip("ExportedProgram only")
    from torch.export.graph_signature import OutputKind

    from hfexport import load_program

    program = components["decode"]
    kinds = [spec.kind for spec in program.graph_signature.output_specs]
    assert kinds.count(OutputKind.USER_INPUT_MUTATION) == 6  # keys, values, length of 2 layers
    path = tmp_path / "decode.pt2"
    torch.export.save(program, str(path))
    loaded = load_program(path)
    _, example = loaded.example_inputs
    cache = copy.deepcopy(example["past_key_values"])
    cache.reset()
    ids, mask = _padded_prompt()
    positions = torch.arange(9)[None].expand(2, 9)
    slots = torch.arange(MAX_CACHE)
    full = torch.zeros(2, MAX_CACHE, dtype=torch.bool)
    full[:, :9] = mask.bool()
    attention = ((slots[None, :] <= positions[0][:, None])[None] & full[:, None, :])[:, None]
    logits = loaded.module()(
        input_ids=ids,
        attention_mask=attention,
        position_ids=(mask.cumsum(-1) - 1).masked_fill(mask == 0, 1),
        past_key_values=cache,
    ).logits
    assert int(cache.layers[0].cumulative_length) == 9
    assert torch.equal(logits[:, -1].argmax(-1), _reference(llama, static=True)[:, 9])


def test_onnx_cache_pairs_are_written_in_place_or_double_buffered_without_copies(
    static_export: tuple[str, dict], llama
) -> None:
    backend, components = static_export
    if backend != "onnx":
        pytest.skip("ONNX Runtime IO binding only")
    seen: list[dict[str, int]] = []
    buffers: dict[str, set[int]] = {}
    drivers: list = []

    def record(driver) -> None:
        drivers.append(driver)
        if not buffers:
            for k in driver.cache:
                spare = driver.spare.get(k)
                buffers[k] = {driver.cache[k].data_ptr()} | ({spare.data_ptr()} if spare is not None else set())
        seen.append(driver.bound_pointers[-1])

    ids, mask = _padded_prompt()
    got = generate(components, ids, mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, on_step=record)
    assert torch.equal(got, _reference(llama, static=True))
    assert len(seen) == NEW_TOKENS - 1 and buffers
    # The key/value caches are written in place (onnx/index-copy-scatter-elements): one buffer each, no spare.
    driver = drivers[-1]
    assert all(d is driver for d in drivers), "one driver for the whole generation"
    in_place = driver.in_place["decode"]
    assert in_place and all(name.endswith(("_keys", "_values")) for name in in_place)
    assert all(len(buffers[name]) == 1 for name in in_place)
    for pointers in seen:
        assert pointers.keys() == buffers.keys()
        for name, pointer in pointers.items():
            assert pointer in buffers[name], name  # only ever the one or two preallocated buffers


def test_written_in_place_needs_a_scatter_that_nothing_else_reads() -> None:
    import onnx
    from onnx import TensorProto, helper

    from hfexport.backends.onnx.driver import written_in_place

    def graph(extra_reader: str | None) -> onnx.ModelProto:
        nodes = [helper.make_node("ScatterElements", ["input.c", "i", "u"], ["output.c"], axis=1)]
        outputs = [helper.make_tensor_value_info("output.c", TensorProto.FLOAT, [2, 4])]
        if extra_reader:
            nodes.append(helper.make_node(extra_reader, ["input.c"], ["r"]))
            outputs.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, None))
        inputs = [
            helper.make_tensor_value_info("input.c", TensorProto.FLOAT, [2, 4]),
            helper.make_tensor_value_info("i", TensorProto.INT64, [2, 1]),
            helper.make_tensor_value_info("u", TensorProto.FLOAT, [2, 1]),
        ]
        return helper.make_model(helper.make_graph(nodes, "g", inputs, outputs))

    assert written_in_place(graph(None)) == {"c"}
    assert written_in_place(graph("Shape")) == {"c"}  # reads the shape only
    assert written_in_place(graph("Neg")) == set()  # would read rows the scatter already overwrote


def test_state_space_model_generates_like_eager() -> None:
    tiny = get_tiny_model("tiny-mamba")
    model = tiny.build()
    components = DynamoExporter().export_for_generation(model, _sample(length=6), DynamoConfig(dynamic=True))
    ids = torch.randint(3, 128, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = model.generate(input_ids=ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    assert torch.equal(generate(components, ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS), expected)


def _corpus_generation(name: str, backend: str) -> tuple[torch.nn.Module, dict[str, Any]]:
    """A generated-corpus causal LM and its generation components (`dynamic=True`)."""
    from hfexport.testing.corpus import load_entry

    entry = load_entry(Path(__file__).parent / f"fixtures/corpus_all/causal_lm/{name}.json")
    model = entry.build_model()
    config = AutoExportConfig.from_dict({"export_format": backend, "dynamic": True})
    return model, AutoHfExporter.from_config(config).export_for_generation(model, entry.sample_inputs(), config)


def _assert_left_padded_generation_like_eager(model: torch.nn.Module, components: Any, seed: int) -> None:
    ids = torch.randint(3, 90, (2, 7), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    with torch.no_grad():
        expected = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
        )
    got = generate(components, ids, mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("backend", ["dynamo", "onnx"])
@pytest.mark.slow
def test_decoder_that_fills_the_cache_without_returning_it_generates_like_eager(backend: str) -> None:
    # A BERT-style decoder built with is_decoder=False (bert-generation as a causal LM) writes each step into the
    # cache it is handed but returns none; generate reads it in place. The graphs must return it.
    model, components = _corpus_generation("bert-generation", backend)
    assert not model.config.is_decoder
    _assert_left_padded_generation_like_eager(model, components, seed=3)


def test_model_that_makes_its_own_cache_in_the_first_forward_generates_like_eager() -> None:
    # MiniMax (linear + full attention) is handed no cache by generate and builds its own in the first forward:
    # the prefill graph has no cache input, the decode graph takes the cache the prefill returned. The Dynamo
    # driver asked the prefill sample for a cache ("KeyError: 'past_key_values'"); ONNX's named feeds did not.
    model, components = _corpus_generation("minimax", "dynamo")
    takes_cache = {
        name: any(i.startswith("past_key_values") for i in components[name].graph_signature.user_inputs)
        for name in ("prefill", "decode")
    }
    assert takes_cache == {"prefill": False, "decode": True}
    _assert_left_padded_generation_like_eager(model, components, seed=5)


@pytest.mark.slow  # a corpus export: 90-150 s at load 16 on the shared 2 cores
def test_recurrent_state_that_is_not_a_cache_generates_like_eager() -> None:
    # RWKV's recurrent state is a list of 5 tensors under `state`, not a transformers Cache; generate carries it
    # from one step's output to the next under that name. The driver ran the whole sequence through the decode
    # graph without it ("expected [..., 'state']"), and the prefill graph kept the prompt's length from the
    # loop over the sequence (patch/rwkv-linear-attention-scan). Its mask covers the current tokens only.
    model, components = _corpus_generation("rwkv", "dynamo")
    assert components.spec.cache_key == "past_key_values" and components.spec.mask_current_only
    _assert_left_padded_generation_like_eager(model, components, seed=7)


def test_model_defined_cache_is_the_decode_graph_input_not_a_fixed_argument() -> None:
    # xLSTM's `xLSTMCache` is a plain class of its modeling module, outside `Cache`'s hierarchy: the decode step
    # fixed the recorded cache object as a Python argument, so the decode graph held the sample's recurrent state
    # as constants that its forward mutates (torch.onnx: "Constant ...mlstm_backend.lifted_tensor_0 is mutated in
    # the forward method"). It is the `past_key_values` input now, and calling the component with it gives the
    # recorded step's logits. Eager only (the export still stops at the config the cache keeps: cache-holds-config).
    from hfexport.core.cache_classes import is_model_cache_class
    from hfexport.testing.corpus import load_entry

    entry = load_entry(Path(__file__).parent / "fixtures/corpus_all/causal_lm/xlstm.json")
    model = entry.build_model()
    components = decompose_for_generation(model, entry.sample_inputs())
    module, kwargs = components["decode"]
    cache = kwargs["past_key_values"]
    assert is_model_cache_class(type(cache)) and type(cache).__name__ == "xLSTMCache"
    assert module.cache_key == "cache" and "cache" not in module.fixed
    assert list(kwargs) == ["input_ids", "attention_mask", "past_key_values"]
    with torch.no_grad():
        expected = model(input_ids=kwargs["input_ids"], cache=copy.deepcopy(cache), use_cache=True).logits
        got = module(**kwargs).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    # The component's eager call leaves the recorded cache as it was (the exported program does too).
    assert int(cache.seqlen_offset) == entry.sample_inputs()["input_ids"].shape[1]


@pytest.mark.slow  # a corpus export: about 80 s at load 7 on the shared 2 cores
def test_model_defined_cache_generates_like_eager_on_onnx() -> None:
    # Reformer's `ReformerDynamicCache` (past buckets and states) is not a transformers Cache either: fixed in the
    # decode component, the ONNX decode graph had no cache input and generate failed ("Got invalid dimensions for
    # input: input_ids"). As the `past_key_values` input it is carried from step to step like any cache. A
    # 7-token prompt and 6 new tokens stay below the 64-token chunk past which eager's LSH rotations are drawn
    # anew on every call (reformer-lsh-random-rotations).
    model, components = _corpus_generation("reformer", "onnx")
    assert components.spec.cache_key == "past_key_values"
    _assert_left_padded_generation_like_eager(model, components, seed=11)


@pytest.mark.slow  # a corpus export: 90-150 s at load 16 on the shared 2 cores
def test_decode_position_from_the_cache_length_generates_like_eager() -> None:
    # ProphetNet's decode step takes its position as int(padding_idx + past + 1): the decode graph kept the
    # sample's cache length (patch/prophetnet-decode-positions-symbolic), and the next step failed its guard.
    model, components = _corpus_generation("prophetnet", "dynamo")
    _assert_left_padded_generation_like_eager(model, components, seed=9)


def test_encoder_decoder_generates_like_eager() -> None:
    tiny = get_tiny_model("tiny-t5")
    model = tiny.build()
    inputs = tiny.sample_inputs()
    inputs.pop("decoder_input_ids")
    components = DynamoExporter().export_for_generation(model, inputs, DynamoConfig(dynamic=True))
    assert list(components) == ["encoder", "prefill", "decode"]
    prompt = tiny.sample_inputs(seed=5)
    ids, mask = prompt["input_ids"][:, :6], prompt["attention_mask"][:, :6].clone()
    mask[1, 4:] = 0  # right padding on the encoder side
    with torch.no_grad():
        expected = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False
        )
    got = generate(components, ids, mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    assert torch.equal(got, expected)


@pytest.mark.slow
def test_vision_language_model_generates_like_eager() -> None:
    # LLaVA-like: get_image_features (encoder + projector) runs first, the prefill graph merges its output at
    # the image tokens, decode steps read them from the cache; no per-model code in the loop.
    tiny = get_tiny_model("tiny-llava")
    model = tiny.build()
    components = DynamoExporter().export_for_generation(model, tiny.sample_inputs(), DynamoConfig(dynamic=True))
    other = tiny.sample_inputs(seed=4)
    ids, mask = other["input_ids"], other["attention_mask"]
    for scale in (1.0, 3.0):  # other pixels give other tokens: the image really goes through the graphs
        images = {
            k: v * scale if k == "pixel_values" else v
            for k, v in other.items()
            if k not in ("input_ids", "attention_mask")
        }
        with torch.no_grad():
            expected = model.generate(
                input_ids=ids,
                attention_mask=mask,
                **images,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
            )
        got = generate(
            components, ids, mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, encoder_inputs=images
        )
        assert torch.equal(got, expected), scale


def test_static_multi_token_decode_exports_one_program_for_prefill_and_decode(llama: torch.nn.Module) -> None:
    # The decode graph takes the prompt on an empty cache, so prefill is that program, not a second export.
    exporter = DynamoExporter()
    components = exporter.export_for_generation(
        llama, _sample(), DynamoConfig(dynamic=True), generation_config=_static(), multi_token_decode=True
    )
    assert list(components) == ["prefill", "decode"]
    assert components["prefill"] is components["decode"]
    assert any("shares the decode program" in note for note in exporter.reports["prefill"].notes)
    # The shared program on the recorded prefill call (8 query tokens, an empty cache) equals the eager prefill.
    module, kwargs = decompose_for_generation(llama, _sample(), generation_config=_static(), multi_token_decode=True)[
        "prefill"
    ]
    with torch.no_grad():
        expected = module(**copy.deepcopy(kwargs)).logits
        got = components["prefill"].module()(**copy.deepcopy(kwargs)).logits
    torch.testing.assert_close(got, expected)
    # Not shared where the prefill trace may differ: static shapes, or a growing cache.
    static_shapes = DynamoExporter().export_for_generation(
        llama, _sample(), DynamoConfig(dynamic=False), generation_config=_static(), multi_token_decode=True
    )
    assert static_shapes["prefill"] is not static_shapes["decode"]
    dynamic_cache = DynamoExporter().export_for_generation(
        llama, _sample(), DynamoConfig(dynamic=True), multi_token_decode=True
    )
    assert dynamic_cache["prefill"] is not dynamic_cache["decode"]


@pytest.mark.slow
def test_executorch_caller_owned_buffers_generate_like_eager(llama: torch.nn.Module) -> None:
    # alloc_* = False: inputs, outputs and the mutable cache live in caller memory, not the planned arena.
    config = ExecutorchConfig(
        dynamic=True, alloc_graph_input=False, alloc_graph_output=False, alloc_mutable_buffers=False
    )
    components = ExecutorchExporter().export_for_generation(
        llama, _sample(), config, generation_config=_static(), multi_token_decode=True
    )
    ids, mask = _padded_prompt()
    got = generate(components, ids, mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)
    assert torch.equal(got, _reference(llama, static=True))


# -- sliding-window caches past the window -----------------------------------------------------------------------

WINDOW = 5


def _sliding_mistral() -> torch.nn.Module:
    from hfexport.rewrites.example_models import sliding_mistral

    return sliding_mistral(WINDOW)


def test_sliding_window_counter_is_a_leaf_with_one_context_before_at_and_past_the_window() -> None:
    from transformers import DynamicCache

    from hfexport.core.cache_pytree import flatten_cache, unflatten_cache

    model = _sliding_mistral()
    cache = DynamicCache(config=model.config)
    contexts, counts = [], []
    for step in range(WINDOW + 3):
        keys = torch.randn(2, 1, 1, 8)
        for layer in range(2):
            cache.update(keys, keys, layer)
        leaves, skeleton = flatten_cache(cache)
        contexts.append(skeleton)
        counter = [leaf for leaf in leaves if leaf.numel() == 0 and leaf.dim() == 2]
        counts.append([tuple(leaf.shape) for leaf in counter])
        rebuilt = unflatten_cache(leaves, skeleton)
        assert [layer.cumulative_length for layer in rebuilt.layers] == [step + 1, step + 1]
        assert rebuilt.layers[0].keys.shape[-2] == min(step + 1, WINDOW - 1)
    # The kept keys stop growing at window - 1 while the counter goes on; the context never changes.
    assert all(c == contexts[0] for c in contexts), "the pytree context changed at the window"
    assert counts[-1] == [(0, WINDOW + 3)] * 2
    # Flattening one object twice gives the same counter tensor (torch.export matches dynamic shapes by identity).
    assert flatten_cache(cache)[0][1] is flatten_cache(cache)[0][1]


@pytest.mark.parametrize("backend", ["dynamo", "onnx"])
@pytest.mark.slow
def test_sliding_window_generates_past_the_window(backend: str, tmp_path: Path) -> None:
    # Window 5: exported from a 3-token prompt (decode sample before the window), then a prompt of 4 whose second
    # row is 3 pads and 1 token, and 12 new tokens: the decode steps run before, at and long past the window on one
    # decode program. The padding matters: the mask's columns are read at `kv_offset`, so an offset taken from the
    # kept keys instead of the counter (ONNX before the counter was an input) masks real tokens as padding. ONNX
    # Runtime gave another 7th new token on the row of 3 pads (a strict xfail) until the mask sizes were read off
    # the kept keys (`count - kept`, no sym_min/sym_max, session 13).
    model = _sliding_mistral()
    exporter_class, config_class = BACKENDS[backend]
    sample = {"input_ids": torch.randint(3, 64, (2, 3), generator=torch.Generator().manual_seed(0))}
    components = exporter_class().export_for_generation(model, sample, config_class(dynamic=True))
    ids = torch.randint(3, 64, (2, 4), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 0
    new = 12
    with torch.no_grad():
        expected = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0
        )
    got = generate(components, ids, mask, max_new_tokens=new, min_new_tokens=new)
    assert torch.equal(got, expected), backend
    if backend == "dynamo":
        # The counter is a graph input and output (its context is saved as such): a loaded artifact generates too.
        loaded = hfexport.load(hfexport.save(components, tmp_path / "gen"), trust=True)
        assert torch.equal(generate(loaded, ids, mask, max_new_tokens=new, min_new_tokens=new), expected)


@pytest.mark.slow
def test_executorch_components_traced_at_batch_one_refuse_a_batch_of_two_by_name() -> None:
    """A program planned for batch 1 (a static decode graph, and the prefill whose size-1 batch was specialised): the
    runtime's own refusal ("set_inputs() ... failed with error 0x10") is explained by the input that does not fit."""
    pytest.importorskip("executorch")
    from hfexport import ExecutorchConfig, ExecutorchExporter
    from hfexport.core.errors import InputError
    from hfexport.runtime import generate
    from hfexport.tiny import get_tiny_model

    model = get_tiny_model("tiny-llama").build()
    ids = torch.randint(3, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    one = {"input_ids": ids[:1], "attention_mask": torch.ones(1, 6, dtype=torch.long)}
    configs = {"prefill": ExecutorchConfig(dynamic=True), "decode": ExecutorchConfig(dynamic=False)}
    static = GenerationConfig(cache_implementation="static", max_cache_len=32)
    components = ExecutorchExporter().export_for_generation(model, one, configs, generation_config=static)
    with torch.no_grad():
        expected = model.generate(ids[:1], max_new_tokens=3, do_sample=False)
    assert torch.equal(generate(components, ids[:1], max_new_tokens=3), expected)
    with pytest.raises(InputError, match="'input_ids' has size 2 on axis 0, but the program was planned for at most 1"):
        generate(components, ids, max_new_tokens=3)
