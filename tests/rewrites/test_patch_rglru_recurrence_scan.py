"""patch/rglru-recurrence-scan: the predicate matches upstream's `_rnn_scan` only; the scanned recurrence, exported
once with a symbolic length, equals upstream's Python loop bit for bit at every length, with and without an initial
state and with a bf16 input over the float32 accumulator (outputs and final state); without the rule the example
is pinned to the sample length. The rule's examples (tests/rewrites/test_examples.py) compare whole models with
eager on Dynamo and ONNX."""

from __future__ import annotations

import pytest
import torch

from hfexport.rewrites.kinds.patch import NOT_APPLICABLE
from hfexport.rewrites.rules.patch.rglru_recurrence_scan import rglru_recurrence_scan as rule
from hfexport.rewrites.rules.patch.rglru_recurrence_scan import runs_rglru_loop, scan_rnn
from hfexport.testing.harness import export_program

modeling = pytest.importorskip("transformers.models.recurrent_gemma.modeling_recurrent_gemma")


def _rglru() -> torch.nn.Module:
    from transformers import RecurrentGemmaConfig

    config = RecurrentGemmaConfig(hidden_size=8, lru_width=8, num_attention_heads=2, vocab_size=16)
    return modeling.RecurrentGemmaRglru(config)


def test_the_predicate_matches_upstreams_rnn_scan_only() -> None:
    class Edited(modeling.RecurrentGemmaRglru):
        def _rnn_scan(self, hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype=torch.float32):
            # Upstream's, but without the reset: another recurrence, which the rule must leave alone.
            contextualized_states = torch.zeros_like(hidden_states)
            for t in range(hidden_states.shape[1]):
                recurrent_states = recurrent_gate[:, t].type(acc_dtype) * recurrent_states
                recurrent_states = recurrent_states + hidden_states[:, t].type(acc_dtype)
                contextualized_states[:, t] = recurrent_states.type(hidden_states.dtype)
            return contextualized_states, recurrent_states

    module = _rglru()
    assert runs_rglru_loop(module)
    edited = Edited.__new__(Edited)
    assert not runs_rglru_loop(edited)
    assert not runs_rglru_loop(torch.nn.Linear(2, 2))


class _Scan(torch.nn.Module):
    """Upstream's `_rnn_scan` through the replacement (which accepts only a symbolic length, i.e. under export)."""

    def __init__(self, with_state: bool) -> None:
        super().__init__()
        self.rglru = _rglru()
        self.with_state = with_state

    def forward(self, hidden, gate, positions, state):
        reset = positions[:, :, None] == 0
        original = type(self.rglru)._rnn_scan
        out = scan_rnn(original, self.rglru, hidden, gate, reset, state if self.with_state else None)
        assert out is not NOT_APPLICABLE  # a symbolic length: the replacement ran
        return out


def _inputs(batch: int, length: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(length)
    hidden = torch.randn(batch, length, 8, generator=generator).to(dtype)
    gate = torch.rand(batch, length, 8, generator=generator).to(dtype)
    positions = torch.arange(length).repeat(batch, 1)
    positions[0, length // 2 :] = torch.arange(length - length // 2)  # a second segment: reset at position 0
    state = torch.randn(batch, 8, generator=generator)  # float32, as upstream's _setup_cache makes it
    return hidden, gate, positions, state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_state", [True, False])
def test_the_scan_equals_upstreams_loop_at_every_length(dtype: torch.dtype, with_state: bool) -> None:
    module = _Scan(with_state)
    length = torch.export.Dim("length", min=2, max=512)
    batch = torch.export.Dim("batch", min=1, max=64)
    shapes = ({0: batch, 1: length}, {0: batch, 1: length}, {0: batch, 1: length}, {0: batch})
    with torch.no_grad():
        program = torch.export.export(module, _inputs(2, 8, dtype), dynamic_shapes=shapes)
        for batch_size, tokens in ((2, 8), (2, 13), (3, 2), (1, 73), (2, 138)):
            hidden, gate, positions, state = _inputs(batch_size, tokens, dtype)
            reset = positions[:, :, None] == 0
            expected = module.rglru._rnn_scan(hidden, gate, reset, state if with_state else None)
            actual = program.module()(hidden, gate, positions, state)
            for a, e in zip(actual, expected, strict=True):
                assert a.dtype == e.dtype and a.shape == e.shape
                torch.testing.assert_close(a, e, atol=0, rtol=0)


@pytest.mark.slow  # 11 s on the shared 2-core machine; test_fix_is_needed proves the same under -m slow
def test_the_first_example_is_pinned_to_the_sample_length_without_the_rule() -> None:
    example = rule.meta.examples[0]
    module, inputs = example.build()
    with torch.no_grad():
        program = export_program(module.eval(), inputs, dynamic=True)
        with pytest.raises(Exception, match=r"Guard failed"):
            program.module()(**example.other_inputs())


class _KeptState(torch.nn.Module):
    """The recurrence with its starting state kept on the module, as RecurrentGemmaRglru keeps
    `self.recurrent_states` from its last eager call (generation's prefill is traced after an eager generate)."""

    def __init__(self, state: torch.Tensor) -> None:
        super().__init__()
        self.rglru = _rglru()
        self.kept = state  # a plain attribute, not a buffer: a real tensor under the trace

    def forward(self, hidden, gate, positions):
        reset = positions[:, :, None] == 0
        return scan_rnn(type(self.rglru)._rnn_scan, self.rglru, hidden, gate, reset, self.kept)


def test_a_state_the_module_kept_from_eager_is_copied_into_the_scan() -> None:
    # It was handed to the scan as it was: "Cannot access data pointer of Tensor" in recurrent_gemma's prefill.
    hidden, gate, positions, state = _inputs(2, 8, torch.float32)
    module = _KeptState(state)
    length = torch.export.Dim("length", min=2, max=512)
    with torch.no_grad():
        program = torch.export.export(module, (hidden, gate, positions), dynamic_shapes=({1: length},) * 3)
        hidden, gate, positions, _ = _inputs(2, 13, torch.float32)
        expected = module.rglru._rnn_scan(hidden, gate, positions[:, :, None] == 0, state)
        for a, e in zip(program.module()(hidden, gate, positions), expected, strict=True):
            torch.testing.assert_close(a, e, atol=0, rtol=0)
