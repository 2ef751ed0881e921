"""Vision-language generation beyond LLaVA: layouts baked into the vision components, modality inputs the
first forward takes itself, per-token inputs, list constants; plus the unit pieces they rest on."""

from __future__ import annotations

import pytest
import torch

from hfexport import DynamoConfig, DynamoExporter, OnnxConfig, OnnxExporter
from hfexport.core.errors import InputError
from hfexport.frontends.generation import specialise_layouts
from hfexport.frontends.torch_export import validate_inputs
from hfexport.naming import canonical_output
from hfexport.runtime.generation import generate
from hfexport.testing.corpus import default_root, load_entry

NEW_TOKENS = 6


def test_canonical_output_orders_fields_as_declared() -> None:
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    out = BaseModelOutputWithPooling(last_hidden_state=torch.ones(1, 2), hidden_states=(torch.zeros(1),))
    out.pooler_output = (torch.full((1,), 2.0),)  # as get_image_features fills it: appended last
    assert list(out.keys()) == ["last_hidden_state", "hidden_states", "pooler_output"]
    fixed = canonical_output(out)
    assert list(fixed.keys()) == ["last_hidden_state", "pooler_output", "hidden_states"]
    leaves, spec = torch.utils._pytree.tree_flatten(fixed)
    rebuilt = torch.utils._pytree.tree_unflatten(leaves, spec)
    assert torch.equal(rebuilt.pooler_output[0], out.pooler_output[0])
    assert torch.equal(rebuilt.hidden_states[0], out.hidden_states[0])


def test_layouts_are_baked_only_into_modality_components() -> None:
    grid = torch.tensor([[1, 2, 2], [1, 4, 1]])
    linear = torch.nn.Linear(2, 2)
    components = {
        "image_features": (linear, {"pixel_values": torch.randn(8, 2), "image_grid_thw": grid}),
        "prefill": (linear, {"input_ids": torch.ones(1, 3, dtype=torch.long), "image_grid_thw": grid}),
    }
    out, layouts = specialise_layouts(components)
    assert layouts == {"image_features": {"image_grid_thw": [[1, 2, 2], [1, 4, 1]]}}
    assert sorted(out["image_features"][1]) == ["pixel_values"]
    assert "image_grid_thw" in out["prefill"][1]  # the language side keeps its input


def test_scalar_lists_are_constants_but_token_lists_are_refused() -> None:
    assert validate_inputs({"output_hidden_states": [-2, -5], "pixel_values": torch.ones(1)}, None)
    with pytest.raises(InputError, match=r"'input_ids' is a list.*return_tensors='pt'"):
        validate_inputs({"input_ids": [1, 2, 3]}, None)


def _entry(name: str) -> tuple[torch.nn.Module, dict, dict, torch.Tensor, torch.Tensor]:
    entry = load_entry(default_root() / "vlm" / f"{name}.json")
    model = entry.build_model()
    sample = entry.sample_inputs()
    grown = dict(entry.grown_inputs())
    ids, mask = grown.pop("input_ids"), grown.pop("attention_mask").clone()
    mask[1, :2] = 0  # left padding on the second row
    return model, sample, grown, ids, mask


def _expected(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor, others: dict) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            **others,
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=0,
        )


@pytest.mark.slow  # two tiny Mistral3 exports (~2 min each on 2 cores)
@pytest.mark.parametrize(("exporter", "config"), [(DynamoExporter, DynamoConfig), (OnnxExporter, OnnxConfig)])
def test_pixtral_image_sizes_are_baked_and_checked(exporter, config) -> None:
    # Mistral3: Pixtral splits patches with image_sizes.tolist(), data-dependent for torch.export; the sizes
    # are baked into the vision components and generate() refuses others.
    model, sample, others, ids, mask = _entry("mistral3")
    components = exporter().export_for_generation(model, sample, config(dynamic=True))
    assert components.spec.components["image_features"].layout == {"image_sizes": sample["image_sizes"].tolist()}
    got = generate(components, ids, mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, encoder_inputs=others)
    assert torch.equal(got, _expected(model, ids, mask, others))
    with pytest.raises(InputError, match=r"image_sizes=.*baked into the graph"):
        generate(
            components,
            ids,
            mask,
            max_new_tokens=2,
            encoder_inputs={**others, "image_sizes": others["image_sizes"] // 2},
        )


def test_first_forward_modality_inputs_and_per_token_inputs() -> None:
    # Fuyu embeds image patches in its own forward (no encoder component); PaliGemma's decode steps take
    # token_type_ids, extended by repeating the prompt's last value as generate does.
    for name in ("fuyu", "paligemma"):
        model, sample, others, ids, mask = _entry(name)
        components = DynamoExporter().export_for_generation(model, sample, DynamoConfig(dynamic=True))
        got = generate(
            components, ids, mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, encoder_inputs=others
        )
        assert torch.equal(got, _expected(model, ids, mask, others)), name


def test_a_decode_step_that_takes_every_token_is_recorded() -> None:
    from hfexport.frontends.describe import _decodes_full_sequence

    linear = torch.nn.Linear(2, 2)
    ids = torch.ones(2, 8, dtype=torch.long)
    whole = {"prefill": (linear, {"input_ids": ids}), "decode": (linear, {"input_ids": torch.ones(2, 9)})}
    one = {"prefill": (linear, {"input_ids": ids}), "decode": (linear, {"input_ids": torch.ones(2, 1)})}
    assert _decodes_full_sequence(whole)  # CPM-Ant: the prompt plus the new token
    assert not _decodes_full_sequence(one)


@pytest.mark.slow  # two tiny VLM exports
@pytest.mark.parametrize("name", ["emu3", "idefics3"])
def test_features_without_a_named_encoder_and_without_a_cache(name: str) -> None:
    # Emu3: a VQ-VAE that get_encoder(modality=...) does not name still gets its image_features component;
    # Idefics3's tiny config has use_cache=False, so every step takes the whole sequence and the features.
    model, sample, others, ids, mask = _entry(name)
    components = DynamoExporter().export_for_generation(model, sample, DynamoConfig(dynamic=True))
    assert "image_features" in components.runtime_components and "image_features" not in components
    got = generate(components, ids, mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, encoder_inputs=others)
    assert torch.equal(got, _expected(model, ids, mask, others))


# -- multimodal rotary positions (Qwen2-VL style) ---------------------------------------------------------------

IMAGE, START, END = 151, 153, 154


def _vl_prompt(rows: list[tuple[list[int], list[int]]], pad: int = 0) -> dict[str, torch.Tensor]:
    """A batch of `text, <start> 4 image tokens <end>, text` rows, left-padded to one length."""
    seqs = [before + [START] + [IMAGE] * 4 + [END] + after for before, after in rows]
    width = max(map(len, seqs))
    ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])
    return {"input_ids": ids, "attention_mask": mask, "mm_token_type_ids": (ids == IMAGE).long()}


def _model_positions(model: torch.nn.Module, prompt: dict[str, torch.Tensor], grid: torch.Tensor) -> torch.Tensor:
    kwargs = {k: v for k, v in prompt.items() if k != "input_ids"}
    return model._prepare_position_ids_for_generation(prompt["input_ids"], {**kwargs, "image_grid_thw": grid})


def test_multimodal_positions_replay_the_models_own_on_another_prompt() -> None:
    from hfexport.core.positions import apply, derive
    from tests.test_generation import tiny_qwen2_vl

    model = tiny_qwen2_vl()
    grid = torch.tensor([[1, 4, 4], [1, 4, 4]])
    sample = _vl_prompt([([5], [7, 8]), ([9], [10, 11])])
    template = derive(
        _model_positions(model, sample, grid),
        sample["input_ids"],
        sample["attention_mask"],
        sample["mm_token_type_ids"],
        "mm_token_type_ids",
        [],
        None,
    )
    assert template is not None and template.text_row and len(template.blocks) == 2
    # Other text lengths around the images, and a left-padded row.
    prompt = _vl_prompt([([5, 6, 7], [8]), ([9], [10, 11, 12, 13])])
    expected = _model_positions(model, prompt, grid)
    got, deltas = apply(template, prompt["input_ids"], prompt["attention_mask"], prompt["mm_token_type_ids"])
    valid = prompt["attention_mask"].bool()
    assert torch.equal(got[:, valid], expected[:, valid])
    assert torch.equal(deltas, model.model.rope_deltas)
    # A prompt whose image block has another size than the exported layout is refused.
    odd = _vl_prompt([([5], [7]), ([9], [10])])
    odd["mm_token_type_ids"][0, 2] = 0
    with pytest.raises(InputError, match="layout"):
        apply(template, odd["input_ids"], odd["attention_mask"], odd["mm_token_type_ids"])


@pytest.mark.slow  # a tiny Qwen2-VL export per backend (~1 min each on 2 cores)
@pytest.mark.parametrize(("exporter", "config"), [(DynamoExporter, DynamoConfig), (OnnxExporter, OnnxConfig)])
def test_qwen2_vl_generates_with_multimodal_positions(exporter, config) -> None:
    from tests.test_generation import tiny_qwen2_vl

    model = tiny_qwen2_vl()
    grid = torch.tensor([[1, 4, 4], [1, 4, 4]])
    pixels = torch.randn(32, 96, generator=torch.Generator().manual_seed(1))
    sample = {**_vl_prompt([([5], [7, 8]), ([9], [10, 11])]), "pixel_values": pixels, "image_grid_thw": grid}
    components = exporter().export_for_generation(model, sample, config(dynamic=True))
    assert components.spec.positions is not None
    prompt = _vl_prompt([([5, 6, 7], [8]), ([9], [10, 11, 12, 13])])
    others = {"pixel_values": pixels, "image_grid_thw": grid, "mm_token_type_ids": prompt["mm_token_type_ids"]}
    ids, mask = prompt["input_ids"], prompt["attention_mask"]
    got = generate(components, ids, mask, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, encoder_inputs=others)
    assert torch.equal(got, _expected(model, ids, mask, others))


@pytest.mark.parametrize("name", ["hunyuan_vl", "glm4v_moe"])
def test_multimodal_positions_follow_the_models_own_when_the_images_move(name: str) -> None:
    # HunYuan-VL's image grid positions are absolute (they stay when text is added in front), its span's start
    # and end tokens and GLM-4V's grids move with the block: both replay as the model computes them.
    from hfexport.core.positions import apply
    from hfexport.frontends.generation import decompose_for_generation, describe

    model, sample, _, _, _ = _entry(name)
    # The positions template is read off the prefill, a runtime component: describe sees every pair.
    template = describe(decompose_for_generation(model, sample).all(), None, model, False, sample).positions
    assert template is not None
    if name == "hunyuan_vl":
        assert any(any(axis) for block in template.blocks for axis in block.absolute)
    ids, types = sample["input_ids"], sample["mm_token_type_ids"]
    text = ids[types == 0][:3].expand(ids.shape[0], -1)
    moved = {
        "input_ids": torch.cat([text, ids], 1),
        "attention_mask": torch.ones(ids.shape[0], ids.shape[1] + 3, dtype=torch.long),
        "mm_token_type_ids": torch.cat([torch.zeros_like(text), types], 1),
    }
    others = {k: v for k, v in sample.items() if k not in moved}
    expected = model._prepare_position_ids_for_generation(moved["input_ids"], {**moved, **others})
    got, deltas = apply(template, moved["input_ids"], moved["attention_mask"], moved["mm_token_type_ids"])
    assert torch.equal(got, expected)
    assert torch.equal(deltas, model.model.rope_deltas)


def test_nested_feature_sequences_are_tensor_fields() -> None:
    # Qwen3-VL's deepstack_features: a list per layer of a tuple per image; dropping it broke the prefill.
    from dataclasses import dataclass

    from transformers.utils import ModelOutput

    from hfexport.frontends.generation import tensor_fields

    @dataclass
    class Features(ModelOutput):
        last_hidden_state: torch.Tensor | None = None
        deepstack: list | None = None
        layer_ids: list | None = None

    out = Features(torch.ones(2, 3), [(torch.zeros(1), torch.zeros(2)), (torch.ones(1), torch.ones(2))], [3, 5])
    kept = tensor_fields({"image": out})["image"]
    assert list(kept.keys()) == ["last_hidden_state", "deepstack"]
