"""Seed contract: a vision-language model's generation components are the documented ones.

The seed (../shared/seeds/000, "Generative models" and "How export_for_generation works"; 004 on quantizing
per component) says `export_for_generation` / `decompose_for_generation` split a multimodal prefill into
`<modality>_encoder`, `multi_modal_projector` (only when the model has one: Qwen2-VL's lives in its vision
tower), `language_model` and `lm_head`, beside `decode`, and that running each encoder, projecting the
embeddings and orchestrating the loop is the caller's job. Here the seed's snippets run as written on tiny
LLaVA and Qwen2-VL models, and a caller's loop runs the documented components in their order (encoder,
projector, merge at the image tokens, language model, lm_head, then decode steps) in torch and in ONNX Runtime,
against `model.generate(do_sample=False)` tokens and eager logits. The seams the caller owns are model code
and say so: LLaVA's feature layer and CLS drop, the text embeddings the image features are merged into,
Qwen2-VL's multimodal positions. `hfexport.runtime.generate` keeps working from the same export, in memory
and saved, through the programs it keeps beside the dict (`runtime_components`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from hfexport import DynamoConfig, DynamoExporter, decompose_for_generation
from hfexport.tiny import get_tiny_model

NEW_TOKENS = 6
LLAVA_COMPONENTS = ["image_encoder", "multi_modal_projector", "language_model", "lm_head", "decode"]
QWEN2_VL_COMPONENTS = ["image_encoder", "language_model", "lm_head", "decode"]


@dataclass
class Case:
    """A tiny VLM, its capture sample, another prompt, and the caller's glue between the documented components."""

    model: torch.nn.Module
    sample: dict[str, torch.Tensor]
    prompt: dict[str, torch.Tensor]
    documented: list[str]
    image_token: int
    # encoder inputs of the prompt, by the image_encoder graph's input names
    encoder_inputs: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]
    # (image_encoder outputs by field, run the projector) -> image embeddings, one row per image token
    image_embeds: Callable[[dict[str, Any], Callable[..., torch.Tensor] | None], torch.Tensor]
    # prompt -> the language model's position_ids
    positions: Callable[[dict[str, torch.Tensor]], torch.Tensor]
    # inputs the decode graph takes besides tokens, mask, positions and cache, for one new text token per row
    decode_extra: Callable[[torch.Tensor], dict[str, torch.Tensor]]

    @property
    def others(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.prompt.items() if k not in ("input_ids", "attention_mask")}


def _text_positions(prompt: dict[str, torch.Tensor]) -> torch.Tensor:
    mask = prompt["attention_mask"]
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


def _llava() -> Case:
    tiny = get_tiny_model("tiny-llava")
    model = tiny.build()
    config = model.config

    def image_embeds(encoded: dict[str, Any], projector: Callable[..., torch.Tensor] | None) -> torch.Tensor:
        # LLaVA's get_image_features: the configured layer's hidden states, the CLS token dropped ("default").
        selected = encoded["hidden_states"][config.vision_feature_layer]
        if config.vision_feature_select_strategy == "default":
            selected = selected[:, 1:]
        assert projector is not None
        return projector(image_features=selected).reshape(-1, config.text_config.hidden_size)

    return Case(
        model=model,
        sample=tiny.sample_inputs(),
        prompt=tiny.sample_inputs(seed=4),
        documented=LLAVA_COMPONENTS,
        image_token=config.image_token_index,
        encoder_inputs=lambda prompt: {"pixel_values": prompt["pixel_values"]},
        image_embeds=image_embeds,
        positions=_text_positions,
        decode_extra=lambda token: {},
    )


def _qwen2_vl() -> Case:
    from tests.test_generation import tiny_qwen2_vl
    from tests.test_generation_multimodal import _vl_prompt

    model = tiny_qwen2_vl()
    grid = torch.tensor([[1, 4, 4], [1, 4, 4]])
    pixels = torch.randn(32, 96, generator=torch.Generator().manual_seed(1))
    images = {"pixel_values": pixels, "image_grid_thw": grid}

    def positions(prompt: dict[str, torch.Tensor]) -> torch.Tensor:
        # Multimodal rotary positions are model code (the rope index over the image grid): the model's own.
        kwargs = {k: v for k, v in prompt.items() if k != "input_ids"}
        return model._prepare_position_ids_for_generation(prompt["input_ids"], kwargs)

    return Case(
        model=model,
        sample={**_vl_prompt([([5], [7, 8]), ([9], [10, 11])]), **images},
        prompt={**_vl_prompt([([5, 6, 7], [8]), ([9, 3, 4], [10, 11])]), **images},
        documented=QWEN2_VL_COMPONENTS,
        image_token=model.config.image_token_id,
        # The vision tower's grid is a layout baked into its graph: the pixels are its only input.
        encoder_inputs=lambda prompt: {"hidden_states": prompt["pixel_values"]},
        # The merger is inside the tower: its pooled output is the image embeddings.
        image_embeds=lambda encoded, projector: encoded["pooler_output"],
        positions=positions,
        # Each new token is text (type 0), as generate extends the prompt's types.
        decode_extra=lambda token: {"mm_token_type_ids": torch.zeros_like(token)},
    )


CASES = {"llava": _llava, "qwen2_vl": _qwen2_vl}


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest) -> Case:
    return CASES[request.param]()


def _reference(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """`model.generate(do_sample=False)` on the prompt, and the eager logits of the prompt's last position."""
    with torch.no_grad():
        tokens = case.model.generate(
            **case.prompt, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )
        logits = case.model(**case.prompt).logits[:, -1]
    return tokens, logits


def _merged_embeddings(case: Case, image_embeds: torch.Tensor) -> torch.Tensor:
    """The prompt's text embeddings with the image embeddings in place of the image tokens (the caller's merge)."""
    ids = case.prompt["input_ids"]
    with torch.no_grad():
        embeds = case.model.get_input_embeddings()(ids)
    mask = (ids == case.image_token)[..., None].expand_as(embeds)
    return embeds.masked_scatter(mask, torch.as_tensor(image_embeds).to(embeds.dtype))


def _leaves(value: Any) -> list[torch.Tensor]:
    from hfexport.core.cache_pytree import register_cache_pytrees

    register_cache_pytrees()
    return [t for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


# -- the documented names --------------------------------------------------------------------------------------


def test_decomposition_names_the_documented_components(case: Case) -> None:
    from hfexport.frontends.generation import runtime_configs, split_config

    components = decompose_for_generation(case.model, case.sample)
    assert list(components) == case.documented
    assert list(components.runtime) == ["image_features", "prefill"]
    # 004: a per-component config (or quantizer) dict names the documented components, and only those.
    configs = {name: DynamoConfig(dynamic=True) for name in components}
    assert split_config(configs, list(components)) == configs
    with pytest.raises(ValueError, match=r"unknown \['prefill'\]"):
        split_config({**configs, "prefill": DynamoConfig()}, list(components))
    derived = runtime_configs(configs, list(components.runtime), per_component=True)
    assert derived["image_features"] is configs["image_encoder"] and derived["prefill"] is configs["decode"]


def test_a_runtime_component_calibrates_on_its_own_sample_under_a_per_component_quantizer() -> None:
    from torchao.quantization.pt2e.quantizer.x86_inductor_quantizer import (
        X86InductorQuantizer,
        get_default_x86_inductor_quantization_config,
    )

    from hfexport import PT2EQuantizer
    from hfexport.frontends.generation import runtime_configs

    x86 = X86InductorQuantizer().set_global(get_default_x86_inductor_quantization_config())
    decode_kwargs = [{"input_ids": torch.ones(1, 1, dtype=torch.long)}]
    configs = {"decode": DynamoConfig(quantizer=PT2EQuantizer(x86, calibration_dataset=decode_kwargs))}
    prefill = runtime_configs(configs, ["prefill"], per_component=True)["prefill"]
    # The decode step's forward kwargs are not the prefill's: it calibrates on its own recorded sample.
    assert prefill.quantizer.calibration_dataset is None
    assert configs["decode"].quantizer.calibration_dataset is decode_kwargs


# -- the seed's decompose_for_generation loop, as written -----------------------------------------------------


@pytest.mark.parametrize("name", [pytest.param("llava"), pytest.param("qwen2_vl", marks=pytest.mark.slow)])
def test_seed_decompose_loop_exports_each_documented_component(name: str) -> None:
    case = CASES[name]()
    model, inputs = case.model, case.sample
    exporter, config = DynamoExporter(), DynamoConfig(dynamic=True)

    # The seed's snippet (000, "How export_for_generation works"), as written.
    components = decompose_for_generation(model, inputs)
    # {"image_encoder": (submodel, fwd_kwargs), "language_model": (...), ..., "decode": (...)}

    exported = {}
    for name, (submodel, subinputs) in components.items():
        eager_outputs = submodel(**subinputs)  # sanity-check the eager forward before exporting
        exported[name] = exporter.export(submodel, subinputs, config=config)

    assert list(exported) == case.documented
    # The eager sanity check left each recorded sample as it was (a growing cache is not grown in place), so
    # every program runs the step that was recorded, and agrees with eager on it.
    fresh = decompose_for_generation(model, inputs)
    for name, (submodel, subinputs) in fresh.items():
        with torch.no_grad():
            expected = submodel(**copy.deepcopy(subinputs))
            got = exported[name].module()(**copy.deepcopy(subinputs))
        assert len(_leaves(got)) == len(_leaves(expected)), name
        for a, b in zip(_leaves(got), _leaves(expected), strict=True):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=name)
    # The seed's own sanity check (the last one, decode's) agrees with the exported decode step.
    with torch.no_grad():
        decode = exported["decode"].module()(**copy.deepcopy(fresh["decode"][1]))
    torch.testing.assert_close(decode.logits, eager_outputs.logits, atol=1e-5, rtol=1e-5)


# -- a caller's loop over the documented components ---------------------------------------------------------


def _export(case: Case, backend: str) -> dict[str, Any]:
    from hfexport import OnnxConfig, OnnxExporter

    model, inputs = case.model, case.sample
    if backend == "dynamo":
        # The seed's snippet (000, "Generative models"), as written.
        exporter = DynamoExporter()
        config = DynamoConfig(dynamic=True)
        components = exporter.export_for_generation(model, inputs, config=config)
        # components = {"image_encoder": ExportedProgram, "language_model": ExportedProgram, ...}
    else:
        exporter = OnnxExporter()
        config = OnnxConfig(dynamic=True)
        components = exporter.export_for_generation(model, inputs, config=config)
    assert list(components) == case.documented
    assert list(components.runtime_components) == ["image_features", "prefill"]
    return components


def _dynamo_loop(case: Case, components: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The documented components in their order, in torch: encoder, projector, merge, language model, lm_head,
    then decode steps on the language model's cache. Returns (prompt + new tokens, the first logits)."""
    prompt = case.prompt
    ids, mask = prompt["input_ids"], prompt["attention_mask"]
    encoded = components["image_encoder"].module()(**case.encoder_inputs(prompt))
    projector = components["multi_modal_projector"].module() if "multi_modal_projector" in components else None
    embeds = _merged_embeddings(case, case.image_embeds(dict(encoded.items()), projector))
    positions = case.positions(prompt)
    # An empty growing cache, as the language model's program was exported with.
    _, example = components["language_model"].example_inputs
    cache = copy.deepcopy(example["past_key_values"])
    out = components["language_model"].module()(
        inputs_embeds=embeds, attention_mask=mask, position_ids=positions, past_key_values=cache
    )
    lm_head = components["lm_head"].module()
    logits = lm_head(input=out.last_hidden_state[:, -1:])
    first_logits, cache = logits[:, -1], out.past_key_values
    decode = components["decode"].module()
    tokens, position = ids, positions[..., -1:]
    for step in range(NEW_TOKENS):
        token = logits[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, token], dim=1)
        if step == NEW_TOKENS - 1:
            break
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        position = position + 1
        out = decode(
            input_ids=token,
            attention_mask=mask,
            position_ids=position,
            **case.decode_extra(token),
            past_key_values=cache,
        )
        logits, cache = out.logits, out.past_key_values
    return tokens, first_logits


def _onnx_loop(case: Case, components: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The same loop in ONNX Runtime: one session per component, fed by input name; the cache is read back from
    the `output.<name>` twin of each `input.<name>`, and starts empty (length 0)."""
    import numpy as np
    import onnxruntime as ort

    sessions = {
        name: ort.InferenceSession(program.model_proto.SerializeToString()) for name, program in components.items()
    }

    def run(name: str, feed: dict[str, Any]) -> dict[str, np.ndarray]:
        session = sessions[name]
        outputs = [o.name for o in session.get_outputs()]
        inputs = {k: np.asarray(v) for k, v in feed.items()}
        return dict(zip(outputs, session.run(None, inputs), strict=True))

    def grouped(outputs: dict[str, np.ndarray]) -> dict[str, Any]:
        # Flat output names back to fields: `hidden_states.2` is item 2 of a list (items the graph does not
        # return stay None), so `hidden_states[-1]` is the last layer's as in torch.
        fields: dict[str, Any] = {}
        for key, value in outputs.items():
            head, _, index = key.partition(".")
            if index.isdigit():
                items = fields.setdefault(head, [])
                items.extend([None] * (int(index) + 1 - len(items)))
                items[int(index)] = torch.from_numpy(value)
            else:
                fields[key] = torch.from_numpy(value)
        return fields

    def cache_of(outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        # A step's cache outputs as the decode graph's cache inputs: `output.<name>` -> `input.<name>`; the
        # language model starts from an empty cache (no input), so its outputs are the cache field's leaves.
        named = {k.removeprefix("output."): v for k, v in outputs.items() if k.startswith("output.")}
        named |= {
            "past_key_values." + k.removeprefix("cache."): v for k, v in outputs.items() if k.startswith("cache.")
        }
        return {"input." + k: v for k, v in named.items()}

    prompt = case.prompt
    ids, mask = prompt["input_ids"], prompt["attention_mask"]
    encoded = grouped(run("image_encoder", {k: v.numpy() for k, v in case.encoder_inputs(prompt).items()}))

    def projector(**kwargs: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(next(iter(run("multi_modal_projector", kwargs).values())))

    embeds = _merged_embeddings(
        case, case.image_embeds(encoded, projector if "multi_modal_projector" in sessions else None)
    )
    positions = case.positions(prompt)
    out = run(
        "language_model",
        {"inputs_embeds": embeds.numpy(), "attention_mask": mask.numpy(), "position_ids": positions.numpy()},
    )
    logits = next(iter(run("lm_head", {"input": out["last_hidden_state"][:, -1:]}).values()))
    first_logits = torch.from_numpy(logits[:, -1])
    cache = cache_of(out)
    assert set(cache) == {i.name for i in sessions["decode"].get_inputs() if i.name.startswith("input.")}
    tokens, position = ids, positions[..., -1:]
    for step in range(NEW_TOKENS):
        token = torch.from_numpy(logits[:, -1].argmax(-1))[:, None]
        tokens = torch.cat([tokens, token], dim=1)
        if step == NEW_TOKENS - 1:
            break
        mask = torch.cat([mask, torch.ones_like(token)], dim=1)
        position = position + 1
        feed = {"input_ids": token, "attention_mask": mask, "position_ids": position, **case.decode_extra(token)}
        out = run("decode", {**{k: v.numpy() for k, v in feed.items()}, **cache})
        logits, cache = out["logits"], cache_of(out)
    return tokens, first_logits


LOOPS = {"dynamo": _dynamo_loop, "onnx": _onnx_loop}


@pytest.mark.parametrize(
    ("name", "backend"),
    [
        pytest.param("llava", "dynamo"),
        pytest.param("qwen2_vl", "dynamo", marks=pytest.mark.slow),
        pytest.param("llava", "onnx", marks=pytest.mark.slow),
        pytest.param("qwen2_vl", "onnx", marks=pytest.mark.slow),
    ],
)
def test_seed_components_run_in_the_callers_loop(name: str, backend: str) -> None:
    from hfexport.runtime.generation import generate

    case = CASES[name]()
    components = _export(case, backend)
    expected_tokens, expected_logits = _reference(case)
    tokens, first_logits = LOOPS[backend](case, components)
    torch.testing.assert_close(first_logits, expected_logits, atol=1e-4, rtol=1e-4)
    assert torch.equal(tokens, expected_tokens)
    # hfexport's own generate runs the same export (its features and prefill programs are kept beside the dict).
    prompt = case.prompt
    got = generate(
        components,
        prompt["input_ids"],
        prompt["attention_mask"],
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        encoder_inputs=case.others,
    )
    assert torch.equal(got, expected_tokens)


# -- hfexport's generate without, and from a saved artifact ------------------------------------------------------


@pytest.mark.slow  # one more LLaVA export
def test_without_runtime_components_the_dict_is_the_same_and_generate_says_what_is_missing() -> None:
    from hfexport.core.errors import InputError
    from hfexport.runtime.generation import generate

    case = _llava()
    components = DynamoExporter().export_for_generation(
        case.model, case.sample, DynamoConfig(dynamic=True), runtime_components=False
    )
    assert list(components) == LLAVA_COMPONENTS and components.runtime_components == {}
    assert components.spec.runtime_components == ["image_features", "prefill"]
    tokens, _ = _dynamo_loop(case, components)
    assert torch.equal(tokens, _reference(case)[0])
    with pytest.raises(InputError, match=r"no \['image_features', 'prefill'\].*runtime_components=True"):
        generate(components, case.prompt["input_ids"], max_new_tokens=2, encoder_inputs=case.others)


BACKENDS = ["dynamo", "onnx", "openvino", "executorch"]


def _saved_cases() -> list[Any]:
    from hfexport.artifacts.errors import ArtifactError

    # torch.export.load (torch 2.13) cannot read back Qwen2-VL's vision tower program: a dead `aten.item` on the
    # baked grid serialises with a bool output ("'bool' object has no attribute 'as_name'"). Its in-memory
    # generate works (test_seed_components_run_in_the_callers_loop); the saved one is a known gap.
    # ExecuTorch's portable convolution takes 3-D or 4-D inputs: Qwen2-VL's Conv3d patch embedding fails at run
    # time ("Expect input tensor to be 3-D or 4-D, but got, 5").
    known = {
        ("qwen2_vl", "dynamo"): pytest.mark.xfail(raises=ArtifactError, strict=True, reason="torch.export serde"),
        ("qwen2_vl", "executorch"): pytest.mark.xfail(raises=RuntimeError, strict=True, reason="ExecuTorch Conv3d"),
    }
    return [
        pytest.param(name, backend, marks=[known[name, backend]] if (name, backend) in known else [])
        for name in CASES
        for backend in BACKENDS
    ]


@pytest.mark.slow  # one export per backend and model, executorch's the longest (minutes on 2 cores)
@pytest.mark.parametrize(("name", "backend"), _saved_cases())
def test_saved_and_loaded_export_generates_on_every_backend(name: str, backend: str, tmp_path: Path) -> None:
    from hfexport import AutoExportConfig, AutoHfExporter, load, save
    from hfexport.runtime.generation import generate

    if backend == "executorch":
        pytest.importorskip("executorch")
    if backend == "openvino":
        pytest.importorskip("openvino")
    case = CASES[name]()
    config = AutoExportConfig.from_dict({"export_format": backend, "dynamic": True})
    exporter = AutoHfExporter.from_config(config)
    components = exporter.export_for_generation(case.model, case.sample, config)
    assert list(components) == case.documented
    out = save(components, tmp_path / "gen", config=config, report=exporter.reports)
    loaded = load(out, trust=True)
    assert set(loaded.components) == {*case.documented, "image_features", "prefill"}
    assert loaded.generation.runtime_components == ["image_features", "prefill"]
    prompt = case.prompt
    expected, _ = _reference(case)
    for source in [components, loaded]:
        got = generate(
            source,
            prompt["input_ids"],
            prompt["attention_mask"],
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            encoder_inputs=case.others,
        )
        assert torch.equal(got, expected), type(source).__name__
