"""The generated corpus of every architecture (issue #17): the generator, the files it wrote, the shape checks.

- `hfexport.testing.corpus_gen` on a few model types: the entry is tiny, loads through `CorpusEntry` and
  reproduces the forward it was checked with; a type that cannot be built comes back with a reason.
- Every file under tests/fixtures/corpus_all is well-formed: it loads, its inputs (and the other shapes of the
  shape checks) materialise, its type is in its family's mapping, and every type of a mapping is either built or
  listed in `_skipped.json` with a reason. No model is built here: that is the generator's job.
- The shape checks (`CorpusEntry.shape_inputs`, `corpus_check.check_entry`) reach 13, 73 and 138 tokens and
  another batch, respect a model's max length, and fail on an export that baked the sample's length in.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from hfexport import DynamoConfig, DynamoExporter
from hfexport.testing.corpus import load_corpus, load_entry
from hfexport.testing.corpus_check import check_entry, failures
from hfexport.testing.corpus_gen import (
    FAMILIES,
    _derived_length,
    _lengthen_waveform,
    family_types,
    generate_entry,
    shrink_config_kwargs,
)

ROOT = Path(__file__).resolve().parent / "fixtures" / "corpus_all"
GENERATED = sorted(p for p in ROOT.glob("*/*.json") if not p.name.startswith("_"))
FAMILY = {f.name: f for f in FAMILIES}


@pytest.mark.parametrize(("family", "model_type"), [("causal_lm", "llama"), ("encoder", "bert")])
def test_generator_builds_a_tiny_entry_that_loads_and_reproduces(tmp_path: Path, family: str, model_type: str) -> None:
    fam = FAMILY[family]
    result = generate_entry(model_type, fam, family_types(fam)[model_type])
    assert result.entry is not None, result.reason
    entry = result.entry
    assert entry["source"].startswith("generated:shrink-level-0")
    assert entry["config"]["num_hidden_layers"] == 2 and entry["config"]["vocab_size"] <= 128
    assert entry["n_params"] < 200_000
    special = {entry["config"].get(k) for k in ("pad_token_id", "bos_token_id", "eos_token_id")} - {None}
    assert special <= set(entry["sample"]["avoid_ids"])
    path = tmp_path / f"{model_type}.json"
    path.write_text(json.dumps(entry))
    loaded = load_entry(path)
    model = loaded.build_model()
    with torch.no_grad():
        out = loaded.main_output(model(**loaded.sample_inputs()))
    assert list(out.shape) == entry["output_shape"]
    if fam.generative:
        assert entry["generate_shape"] == [2, 8 + 3]


def test_a_type_with_a_tester_config_is_built_from_it_before_any_shrinking() -> None:
    # DBRX's shrunk defaults fail at every level (its attention config lacks rope_theta); its tester config
    # (hfexport/testing/tester_configs.json) states one and builds.
    fam = FAMILY["causal_lm"]
    result = generate_entry("dbrx", fam, family_types(fam)["dbrx"])
    assert result.entry is not None, result.reason
    assert result.entry["source"].startswith("tester:tests/models/dbrx/test_modeling_dbrx.py")
    assert result.entry["config"]["attn_config"]["rope_theta"] == 500000


VARIANTS = Path(__file__).resolve().parent / "fixtures" / "corpus_variants"


def test_every_variant_file_names_its_type_and_variant_and_has_a_built_entry() -> None:
    for path in sorted(VARIANTS.glob("*/*@*.json")):
        raw = json.loads(path.read_text())
        assert path.stem == f"{raw['model_type']}@{raw['variant']}", path
        assert (ROOT / path.parent.name / f"{raw['model_type']}.json").exists(), path
        assert load_entry(path).name == f"{path.parent.name}/{path.stem}"


def test_a_waveform_sample_is_lengthened_until_every_derived_axis_has_two_frames() -> None:
    # moonshine's tester sample (1000 samples) leaves its encoder 1 frame (conv strides 64, 3, 2): torch.export
    # specialises that size-1 axis (`size-one-derived-axis-sample`). 1279 is the first length that gives 2.
    entry = json.loads((ROOT / "speech_seq2seq" / "moonshine.json").read_text())
    inputs = entry["sample"]["inputs"]
    inputs["input_values"]["shape"][1] = inputs["attention_mask"]["shape"][1] = 1000
    assert _lengthen_waveform(entry) == 1279
    assert inputs["input_values"]["shape"] == inputs["attention_mask"]["shape"] == [2, 1279]
    assert inputs["decoder_input_ids"]["values"][0][:1] == [85]  # other inputs untouched
    model = load_entry(ROOT / "speech_seq2seq" / "moonshine.json").build_model()
    assert [_derived_length(model, n) for n in (1000, 1278, 1279)] == [1, 1, 2]
    with torch.no_grad():  # the encoder really has 2 frames on the new sample
        encoded = model.get_encoder()(torch.rand(2, 1279), attention_mask=torch.ones(2, 1279, dtype=torch.int64))
    assert encoded.last_hidden_state.shape[1] == 2
    # A sample already long enough stays as it is (wav2vec2: 4000 samples, 12 frames).
    wav2vec2 = json.loads((ROOT / "ctc" / "wav2vec2.json").read_text())
    assert _lengthen_waveform(wav2vec2) is None
    assert wav2vec2["sample"]["inputs"]["input_values"]["shape"] == [2, 4000]


def test_generator_reports_a_type_it_cannot_build_instead_of_raising() -> None:
    result = generate_entry("no_such_model_type", FAMILY["causal_lm"], "AutoModelForCausalLM")
    assert result.entry is None
    assert "no_such_model_type" in result.reason and result.reason.count("level ") == 4


def test_generated_corpus_exists_for_every_family() -> None:
    assert {p.parent.name for p in GENERATED} >= {"causal_lm", "seq2seq", "encoder", "vlm", "image_classification"}


@pytest.mark.parametrize("family", [f.name for f in FAMILIES if (ROOT / f.name).is_dir()])
def test_every_type_of_a_mapping_is_built_or_skipped_with_a_reason(family: str) -> None:
    directory = ROOT / family
    built = {p.stem for p in directory.glob("*.json") if not p.name.startswith("_")}
    skipped = json.loads((directory / "_skipped.json").read_text())
    assert not built & set(skipped)
    assert all(reason.strip() for reason in skipped.values())
    assert built | set(skipped) == set(family_types(FAMILY[family]))
    assert (directory / "README.md").read_text().count("\n| ") >= len(skipped)


@pytest.mark.parametrize("path", GENERATED, ids=[f"{p.parent.name}/{p.stem}" for p in GENERATED])
def test_generated_entry_is_well_formed_and_its_inputs_materialise(path: Path) -> None:
    entry = load_entry(path)
    assert entry.family == path.parent.name and entry.model_type == path.stem
    assert family_types(FAMILY[entry.family])[entry.model_type] == entry.auto_class
    inputs = entry.sample_inputs()
    assert inputs and all(isinstance(t, torch.Tensor) for t in inputs.values())
    lo, hi = entry.sample["text_range"]
    if "input_ids" in inputs and "input_ids" in entry.sample.get("grow", {}):
        grown = entry.grown_inputs()["input_ids"][:, inputs["input_ids"].shape[1] :]
        assert grown.min() >= lo and grown.max() < hi
        assert not set(grown.flatten().tolist()) & set(entry.sample["avoid_ids"])
    shapes = entry.shape_inputs()
    assert "batch+1" in shapes
    if entry.sample.get("grow"):
        assert "grown" in shapes


def _llama():
    return next(e for e in load_corpus(family="causal_lm") if e.model_type == "llama")


def test_shape_inputs_reach_13_73_138_tokens_and_another_batch() -> None:
    entry = _llama()
    shapes = {name: feed["input_ids"].shape for name, feed in entry.shape_inputs().items()}
    assert shapes == {
        "grown": (2, 13),
        "long": (2, 73),
        "longer": (2, 138),
        "batch+1": (3, 8),
    }
    # the long inputs extend the sample, they do not replace it
    assert torch.equal(entry.shape_inputs()["longer"]["input_ids"][:, :8], entry.sample_inputs()["input_ids"])


def test_shape_inputs_leave_out_lengths_past_the_models_max_length() -> None:
    entry = _llama()
    entry.sample = {**entry.sample, "max_length": 100}
    assert set(entry.shape_inputs()) == {"grown", "long", "batch+1"}


def test_shape_checks_fail_on_an_export_that_baked_the_sample_length_in() -> None:
    entry = _llama()
    model = entry.build_model()
    static = DynamoExporter().export(model, entry.sample_inputs(), DynamoConfig(dynamic=False)).module()
    checks = check_entry(entry, model, lambda feed: static(**feed), tolerance=1e-4)
    by_name = {c.name: c for c in checks}
    assert by_name["sample"].ok
    assert not by_name["longer"].ok and by_name["longer"].problem
    assert {line.split(" ")[0] for line in failures(checks)} == {"grown", "long", "longer", "batch+1"}


def test_load_corpus_reads_the_generated_families_without_their_skip_records() -> None:
    entries = load_corpus(ROOT, family="ctc")
    assert entries and all(e.family == "ctc" for e in entries)
    assert len(entries) == len([p for p in (ROOT / "ctc").glob("*.json") if not p.name.startswith("_")])


# --- shrink rules for the types the generator used to skip (issue #17, session 15) ---------------------------------
# Each rule is checked on the kwargs alone (no model is built): the class defaults, the kwargs and the relation kept.


def _kwargs(model_type: str, level: int = 0, fill_none: bool = False, wide: bool = False) -> dict:
    from transformers import CONFIG_MAPPING

    return shrink_config_kwargs(CONFIG_MAPPING[model_type], level, fill_none, wide)


def test_mla_head_dim_stays_the_rope_head_size() -> None:
    # AXK1 / LongCat-Flash / DeepSeek-V3 build the rotary tables for head_dim = qk_rope_head_dim; 16 vs 8 failed.
    for model_type in ("axk1", "longcat_flash", "deepseek_v3"):
        kwargs = _kwargs(model_type)
        assert kwargs["head_dim"] == kwargs["qk_rope_head_dim"] == 8, model_type


def test_a_layer_kind_cycle_keeps_both_kinds_in_two_layers() -> None:
    # RecurrentGemma's (recurrent, recurrent, attention) cut to 2 layers was all recurrent: no attention cache.
    assert _kwargs("recurrent_gemma")["block_types"] == ["recurrent", "attention"]


def test_a_depth_split_into_named_parts_keeps_one_layer_per_part() -> None:
    # Dory: n_input + n_recurrent + n_output = num_hidden_layers. Cut to 2 layers with the parts at 8 and 8, the
    # derived recurrent part was -14 and every layer ran twice on one cache.
    from transformers import CONFIG_MAPPING

    kwargs = _kwargs("dory")
    assert (kwargs["n_input_layers"], kwargs["n_recurrent_layers"], kwargs["n_output_layers"]) == (1, 1, 1)
    assert kwargs["num_hidden_layers"] == 3 and set(kwargs["layer_types"]) == {"sliding_attention", "full_attention"}
    config = CONFIG_MAPPING["dory"](**kwargs)
    assert config.n_input_layers + config.n_recurrent_layers + config.n_output_layers == config.num_hidden_layers == 3
    assert "num_first_full_attention_layers" not in _kwargs("sapiens2")  # 8 + 8 of 24 layers: not a split


def test_kv_sharing_goes_and_per_layer_ffn_widths_shrink() -> None:
    kwargs = _kwargs("gemma3n_text")
    assert kwargs["num_kv_shared_layers"] == 0
    assert kwargs["intermediate_size"] == [64, 64]


def test_vocab_like_and_other_tower_widths_shrink() -> None:
    blt = _kwargs("blt")
    assert blt["encoder_hash_byte_group_vocab"] == 128
    assert blt["encoder_config"]["hidden_size_global"] == blt["decoder_config"]["hidden_size_global"] == 32
    assert _kwargs("inkling2_text")["unpadded_vocab_size"] == 128  # the lm_head's own vocabulary
    assert _kwargs("dots3_note")["vision_config"]["adapter_out_dim"] == 32  # must equal the text width
    perceiver = _kwargs("perceiver")
    assert (perceiver["d_latents"], perceiver["num_latents"], perceiver["num_self_attends_per_block"]) == (32, 16, 2)
    vibevoice = _kwargs("vibevoice_asr")["acoustic_tokenizer_encoder_config"]
    assert vibevoice["num_filters"] == 4 and vibevoice["depths"] == [1] * 7  # a tuple in the class


def test_none_size_fields_are_filled_only_on_request() -> None:
    assert "head_dim" not in _kwargs("ministral")
    assert _kwargs("ministral", fill_none=True)["head_dim"] == 16  # 32 wide / 2 heads
    dots1 = _kwargs("dots1", fill_none=True)
    assert (dots1["n_routed_experts"], dots1["num_experts_per_tok"], dots1["n_shared_experts"]) == (4, 2, 1)
    assert _kwargs("lfm2_moe", fill_none=True)["layer_types"] == ["full_attention"] * 2
    assert _kwargs("nemotron", fill_none=True)["num_key_value_heads"] == 2
    qsa = _kwargs("qwen4_exp_text", fill_none=True)  # the QSA indexer the default layer types use
    assert [qsa[f"indexer_{k}"] for k in ("n_heads", "kv_heads", "head_dim", "budget", "compress_ratio")] == [
        2,
        1,
        16,
        16,
        4,
    ]
    rope = _kwargs("cohere_compass_text", fill_none=True)["rope_parameters"]
    assert set(rope) == {"full_attention"} and rope["full_attention"]["mrope_section"] == [2, 3, 3]


def test_a_type_that_builds_only_with_none_fields_filled_says_so() -> None:
    fam = FAMILY["causal_lm"]
    result = generate_entry("ministral", fam, family_types(fam)["ministral"])
    assert result.entry is not None, result.reason
    assert result.entry["source"] == "generated:shrink-level-0+fill-none"
    assert result.entry["config"]["head_dim"] == 16
    # llama builds on the plain kwargs: no fill there
    assert generate_entry("llama", fam, family_types(fam)["llama"]).entry["source"] == "generated:shrink-level-0"


def test_seq2seq_candidates_follow_the_forward_signature() -> None:
    from transformers import CONFIG_MAPPING

    from hfexport.testing.corpus_gen import _forward_params, candidates

    def cands(model_type: str) -> list:
        config = CONFIG_MAPPING[model_type](**_kwargs(model_type))
        return candidates("seq2seq", _forward_params("AutoModelForSeq2SeqLM", config), config)

    # VibeVoice ASR is a decoder-only LM in the seq2seq mapping: no decoder_input_ids for it to ignore.
    assert set(cands("vibevoice_asr")[0].inputs) == {"input_ids", "attention_mask"}
    assert "decoder_input_ids" in cands("t5")[0].inputs
    # Voxtral Realtime needs text and audio; its mel bins (128) are its audio config's, not the default 80.
    audio = cands("voxtral_realtime")[1].inputs
    assert {"input_ids", "input_features"} <= set(audio) and 128 in audio["input_features"]["shape"]


def test_sequence_classification_of_a_composite_config_gets_a_pad_id_on_its_text_config() -> None:
    fam = FAMILY["encoder"]
    result = generate_entry("qwen3_5", fam, family_types(fam)["qwen3_5"])
    assert result.entry is not None, result.reason
    assert result.entry["config"]["text_config"]["pad_token_id"] is not None


def test_skip_causes_name_transformers_inconsistencies() -> None:
    from hfexport.testing.corpus_readmes import skip_cause

    missing = "level 0: AttributeError: 'DbrxAttentionConfig' object has no attribute 'rope_theta' || level 1: x"
    assert skip_cause(missing) == "model reads a field its config lacks"
    assert skip_cause("level 0: ValueError: inputs_embeds and shared_kv_states cannot be None.") == (
        "needs another model's state"
    )
    assert skip_cause("level 0: TypeError: unsupported operand type(s) for //: 'NoneType' and 'NoneType'") == (
        "config default left None"
    )
    assert skip_cause("level 0: ValueError: There is an issue with your definition of `tie_weights_keys`") == (
        "needs more layers than 2"
    )


def test_the_wide_pass_keeps_heads_and_quadruples_sizes() -> None:
    # xLSTM's cache state rounds hidden * 0.5 up to a multiple of 64, its layer does not: 32 wide breaks, 128 runs.
    plain, wide = _kwargs("xlstm"), _kwargs("xlstm", wide=True)
    assert (plain["hidden_size"], wide["hidden_size"]) == (32, 128)
    assert wide["num_heads"] == plain["num_heads"] == 2 and wide["num_hidden_layers"] == 2
    llama = _kwargs("llama", wide=True)
    assert (llama["hidden_size"], llama["intermediate_size"], llama["num_attention_heads"]) == (128, 256, 2)


def test_a_zero_initialised_router_gets_a_seeded_draw_and_nothing_else_changes() -> None:
    """afmoe's `_init_weights` zeros its router: every expert would tie in `topk`. The corpus build draws that
    weight (reproducibly) and leaves every other weight as the model initialised it."""
    import transformers
    from transformers import CONFIG_MAPPING

    entry = load_entry(ROOT / "causal_lm" / "afmoe.json")
    built, again = entry.build_model(seed=0), entry.build_model(seed=0)
    torch.manual_seed(0)
    plain = getattr(transformers, entry.auto_class).from_config(CONFIG_MAPPING["afmoe"].from_dict(entry.config))
    routers = [n for n, p in plain.named_parameters() if n.endswith("router.gate.weight")]
    assert routers and all(not plain.get_parameter(n).any() for n in routers)
    for name, weight in built.named_parameters():
        if name in routers:
            assert weight.any() and torch.equal(weight, again.get_parameter(name)), name
        else:
            assert torch.equal(weight, plain.get_parameter(name)), name
