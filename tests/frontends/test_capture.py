"""The torch.export frontend: input checks before tracing, dynamic shapes, model state, cache pytrees."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.export import Dim

from hfexport import DynamoConfig, DynamoExporter, InputError
from hfexport.tiny import get_tiny_model


@pytest.fixture(scope="module")
def tiny_llama():
    tiny = get_tiny_model("tiny-llama")
    return tiny.build(), tiny.sample_inputs()


def _fingerprint(model: torch.nn.Module) -> tuple:
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return state, model.training, dict(vars(model)).keys(), model.config._attn_implementation


def _assert_untouched(model: torch.nn.Module, before: tuple) -> None:
    state, training, attrs, attn = before
    assert model.training == training
    assert dict(vars(model)).keys() == attrs
    assert model.config._attn_implementation == attn
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), name


@pytest.mark.parametrize(
    ("inputs", "shapes", "message"),
    [
        ([torch.ones(1, 2)], None, "mapping"),
        ({}, None, "empty"),
        ({"input_ids": "hello"}, None, "return_tensors"),
        ({"input_ids": torch.ones(1, 4, dtype=torch.long)}, {"input_idz": {0: Dim.AUTO}}, "not sample inputs"),
        ({"input_ids": torch.ones(1, 4, dtype=torch.long)}, {"input_ids": {2: Dim.AUTO}}, "axis 2"),
        ({"input_ids": torch.ones(1, 4, dtype=torch.long)}, {"input_ids": Dim.AUTO}, "dict"),
    ],
)
def test_bad_inputs_fail_before_tracing(tiny_llama, inputs, shapes, message) -> None:
    model, _ = tiny_llama
    before = _fingerprint(model)
    exporter = DynamoExporter()
    with pytest.raises(InputError, match=message):
        exporter.export(model, inputs, DynamoConfig(dynamic_shapes=shapes))
    _assert_untouched(model, before)
    assert exporter.report is None, "nothing was traced, so there is no report"


def test_dynamic_true_accepts_other_batch_and_length(tiny_llama) -> None:
    model, inputs = tiny_llama
    before = _fingerprint(model)
    program = DynamoExporter().export(model, inputs, DynamoConfig(dynamic=True))
    _assert_untouched(model, before)
    for batch, length in [(2, 8), (3, 13), (2, 2)]:
        ids = torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(length))
        mask = torch.ones_like(ids)
        mask[0, : length // 2] = 0  # left padding on one row
        with torch.no_grad():
            expected = model(input_ids=ids, attention_mask=mask).logits
        actual = program.module()(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def test_static_export_is_specialised(tiny_llama) -> None:
    model, inputs = tiny_llama
    program = DynamoExporter().export(model, inputs, DynamoConfig(dynamic=False))
    ids = torch.randint(3, 128, (2, 5))
    with pytest.raises(Exception, match=r"(?i)guard|shape|expected"):
        program.module()(input_ids=ids, attention_mask=torch.ones_like(ids))


def test_explicit_dynamic_shapes_pass_through(tiny_llama) -> None:
    model, inputs = tiny_llama
    seq = Dim("seq", min=2, max=64)
    config = DynamoConfig(dynamic_shapes={"input_ids": {1: seq}, "attention_mask": {1: seq}})
    program = DynamoExporter().export(model, inputs, config)
    ranges = {(r.lower, r.upper) for r in program.range_constraints.values()}
    assert (2, 64) in ranges
    ids = torch.randint(3, 128, (2, 11))
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    torch.testing.assert_close(program.module()(input_ids=ids, attention_mask=torch.ones_like(ids)).logits, expected)


def test_training_mode_is_exported_in_eval_and_restored(tiny_llama) -> None:
    model, inputs = tiny_llama
    model.train()
    try:
        exporter = DynamoExporter()
        program = exporter.export(model, inputs, DynamoConfig())
        assert model.training and all(m.training for m in model.modules())
        assert any("training mode" in w for w in exporter.report.warnings)
        model.eval()
        with torch.no_grad():
            expected = model(**inputs).logits
        torch.testing.assert_close(program.module()(**inputs).logits, expected)
    finally:
        model.eval()


def test_flash_attention_is_traced_as_sdpa_and_restored() -> None:
    tiny = get_tiny_model("tiny-llama")
    model = tiny.build()
    with torch.no_grad():
        expected = model(**tiny.sample_inputs()).logits
    model.config._attn_implementation_internal = "flash_attention_2"
    exporter = DynamoExporter()
    program = exporter.export(model, tiny.sample_inputs(), DynamoConfig())
    assert model.config._attn_implementation == "flash_attention_2"
    assert any("flash_attention_2" in w and "sdpa" in w for w in exporter.report.warnings)
    torch.testing.assert_close(program.module()(**tiny.sample_inputs()).logits, expected, atol=1e-5, rtol=1e-5)


def test_unexportable_attention_is_refused_before_tracing() -> None:
    tiny = get_tiny_model("tiny-llama")
    model = tiny.build()
    model.config._attn_implementation_internal = "paged|sdpa"
    with pytest.raises(InputError, match="attn_implementation='sdpa'"):
        DynamoExporter().export(model, tiny.sample_inputs())
    assert model.config._attn_implementation == "paged|sdpa"


class MemoisingRotary(torch.nn.Module):
    """Like the wav2vec2-conformer rotary embedding: memoises its last result on the instance."""

    def __init__(self) -> None:
        super().__init__()
        self.cached_sequence_length = None
        self.cached_rotary_positional_embedding = None
        self.calls_with_cache = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cached_rotary_positional_embedding is not None and self.cached_sequence_length == x.shape[1]:
            self.calls_with_cache += 1
            return x + self.cached_rotary_positional_embedding
        emb = torch.arange(x.shape[1], dtype=x.dtype)[None, :, None].sin()
        self.cached_sequence_length = x.shape[1]
        self.cached_rotary_positional_embedding = emb
        return x + emb


def test_stateful_attributes_are_cleared_for_the_trace_and_restored() -> None:
    model = MemoisingRotary()
    x = torch.randn(2, 6, 4)
    model(x)  # eager call memoises a real tensor
    memo = model.cached_rotary_positional_embedding
    program = DynamoExporter().export(model, {"x": x}, DynamoConfig(dynamic=True))
    assert model.cached_rotary_positional_embedding is memo, "the eager memo is restored, not a FakeTensor"
    assert model.calls_with_cache == 0, "the trace recomputed instead of baking the memo in"
    assert type(model.cached_sequence_length) is int, "no SymInt is left behind"
    longer = torch.randn(2, 9, 4)
    torch.testing.assert_close(program.module()(x=longer), MemoisingRotary()(longer))
    fresh = MemoisingRotary()
    DynamoExporter().export(fresh, {"x": x}, DynamoConfig(dynamic=True))
    assert fresh.cached_rotary_positional_embedding is None, "no FakeTensor memo is left behind"
    assert fresh.cached_sequence_length is None


def test_static_cache_input_round_trips_through_save_and_load(tmp_path: Path) -> None:
    from transformers import StaticCache

    tiny = get_tiny_model("tiny-llama")
    model = tiny.build()
    cfg = model.config
    cache = StaticCache(config=cfg, max_cache_len=16)
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    cache.early_initialization(2, cfg.num_key_value_heads, head_dim, torch.float32, torch.device("cpu"))
    ids = torch.randint(3, 128, (2, 3))
    positions = torch.arange(3)[None].expand(2, 3)
    program = DynamoExporter().export(
        model, {"input_ids": ids, "position_ids": positions, "cache": cache}, DynamoConfig(dynamic=True)
    )
    eager_cache, exported_cache = copy.deepcopy(cache), copy.deepcopy(cache)
    with torch.no_grad():
        expected = model(input_ids=ids, position_ids=positions, cache=eager_cache).logits
    actual = program.module()(input_ids=ids, position_ids=positions, cache=exported_cache).logits
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
    # the exported program writes the cache in place, like eager
    torch.testing.assert_close(exported_cache.layers[0].keys, eager_cache.layers[0].keys)
    assert cache.layers[0].keys.abs().sum() == 0, "the caller's sample cache is untouched"

    path = tmp_path / "decode.pt2"
    torch.export.save(program, path)
    script = f"""
        import copy, torch
        import transformers.modeling_outputs
        from transformers import StaticCache
        from hfexport import register_pytree_node
        register_pytree_node(StaticCache)
        program = torch.export.load({str(path)!r})
        _, kwargs = program.example_inputs
        cache = copy.deepcopy(kwargs["cache"])
        cache.reset()
        out = program.module()(input_ids=kwargs["input_ids"], position_ids=kwargs["position_ids"], cache=cache)
        assert isinstance(cache, StaticCache), type(cache)
        assert int(cache.layers[0].cumulative_length) == 3, cache.layers[0].cumulative_length
        print("shape", tuple(out.logits.shape))
    """
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "shape (2, 3, 128)" in result.stdout


def test_strict_and_deferred_asserts_reach_torch_export(tiny_llama) -> None:
    model, inputs = tiny_llama
    # strict=True traces with TorchDynamo: the graph is the same model, so outputs still match eager
    program = DynamoExporter().export(model, inputs, DynamoConfig(strict=True))
    with torch.no_grad():
        torch.testing.assert_close(program.module()(**inputs).logits, model(**inputs).logits)
    # with explicit bounds and deferred asserts the program covers the whole range
    seq = Dim("seq", min=2, max=32)
    config = DynamoConfig(
        dynamic_shapes={"input_ids": {1: seq}, "attention_mask": {1: seq}},
        prefer_deferred_runtime_asserts_over_guards=True,
    )
    program = DynamoExporter().export(model, inputs, config)
    ids = torch.randint(3, 128, (2, 31))
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    torch.testing.assert_close(program.module()(input_ids=ids, attention_mask=torch.ones_like(ids)).logits, expected)
    with pytest.raises(Exception, match=r"(?i)range|guard|<= 32|constraint"):
        too_long = torch.randint(3, 128, (2, 40))
        program.module()(input_ids=too_long, attention_mask=torch.ones_like(too_long))


def test_a_class_method_patch_is_gated_only_for_models_of_its_module(tiny_llama) -> None:
    """`patch/deepseek-v4-window-buffer` gates a method of a DeepSeek-V4 cache class: once that modeling module
    is imported (by any earlier export or test), a strict export of another model must not find the gate
    installed (it was, and refused a Llama: 'strict=True cannot trace the module-function patches')."""
    import importlib

    importlib.import_module("transformers.models.deepseek_v4.modeling_deepseek_v4")
    model, inputs = tiny_llama
    program = DynamoExporter().export(model, inputs, DynamoConfig(strict=True))
    with torch.no_grad():
        torch.testing.assert_close(program.module()(**inputs).logits, model(**inputs).logits)


def test_size_one_sample_axis_is_reported() -> None:
    tiny = get_tiny_model("tiny-llama")
    ids = torch.randint(3, 128, (1, 6))
    exporter = DynamoExporter()
    exporter.export(
        tiny.build(), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, DynamoConfig(dynamic=True)
    )
    assert any("input_ids has size 1 on axis [0]" in w for w in exporter.report.warnings)


def test_size_one_warning_spares_the_head_axis_of_a_4d_mask() -> None:
    """A static cache's decode sample carries transformers' [batch, 1, query, key] mask: its axis 1 broadcasts over
    the heads, so "trace with size >= 2 there" would be wrong advice; the other size-1 axes are still named."""
    from hfexport.frontends.torch_export import size_one_axis_warnings

    warnings = size_one_axis_warnings(
        {
            "input_ids": torch.ones(2, 1, dtype=torch.long),
            "attention_mask": torch.ones(2, 1, 1, 32),
            "pixel_mask": torch.ones(2, 1, 4, 4),
        }
    )
    assert warnings == [
        "input_ids has size 1 on axis [1] in the sample: that axis is exported static; trace with a sample of size "
        ">= 2 there to keep it dynamic",
        "attention_mask has size 1 on axis [2] in the sample: that axis is exported static; trace with a sample of "
        "size >= 2 there to keep it dynamic",
        "pixel_mask has size 1 on axis [1] in the sample: that axis is exported static; trace with a sample of size "
        ">= 2 there to keep it dynamic",
    ]
    assert size_one_axis_warnings({"attention_mask": torch.ones(2, 1, 8, 32)}) == []


def test_strict_export_refuses_gated_patches_before_tracing() -> None:
    tiny = get_tiny_model("tiny-mamba")
    model = tiny.build()
    # Mamba's selective scan patch is a gated module function.
    with pytest.raises(InputError, match="patch/mamba-selective-scan-hop"):
        DynamoExporter().export(model, tiny.sample_inputs(), DynamoConfig(strict=True))
    assert "forward" not in vars(model)
