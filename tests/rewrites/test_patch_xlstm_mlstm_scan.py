"""patch/xlstm-mlstm-scan: the scanned mLSTM, exported once with a symbolic length, equals upstream's inference
kernel (the chunkwise form over whole chunks, then the per-token loop) at lengths below, at and past `chunk_size`,
from zero states and from given ones (a cache's), hidden states and last states both; a concrete length and the
train mode are left to upstream. The rule's examples (tests/rewrites/test_examples.py) compare whole models with
eager on Dynamo and ONNX."""

from __future__ import annotations

import pytest
import torch

from hfexport.rewrites.kinds.patch import NOT_APPLICABLE
from hfexport.rewrites.rules.patch.xlstm_mlstm_scan import scan_mlstm

modeling = pytest.importorskip("transformers.models.xlstm.modeling_xlstm")

HEADS, DIM_QK, DIM_V, CHUNK = 2, 4, 6, 4


def _backend(mode: str = "inference") -> torch.nn.Module:
    from transformers import xLSTMConfig

    config = xLSTMConfig(chunk_size=CHUNK, mode=mode, inference_state_dtype="float32")
    return modeling.xLSTMBackend(config)


class _Scan(torch.nn.Module):
    """Upstream's backend forward through the replacement (which accepts only a symbolic length: under export)."""

    def __init__(self, with_states: bool) -> None:
        super().__init__()
        self.backend = _backend()
        self.with_states = with_states

    def forward(self, query, key, value, igate, fgate, c, n, m):
        states = (c, n, m) if self.with_states else (None, None, None)
        out = scan_mlstm(type(self.backend).forward, self.backend, query, key, value, igate, fgate, *states)
        assert out is not NOT_APPLICABLE  # a symbolic length: the replacement ran
        return out


def _inputs(batch: int, length: int) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(length)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    qkv = (randn(batch, HEADS, length, DIM_QK), randn(batch, HEADS, length, DIM_QK), randn(batch, HEADS, length, DIM_V))
    gates = (randn(batch, HEADS, length), 3 + randn(batch, HEADS, length))
    states = (randn(batch, HEADS, DIM_QK, DIM_V), randn(batch, HEADS, DIM_QK).abs(), randn(batch, HEADS, 1))
    return (*qkv, *gates, *states)


@pytest.mark.parametrize("with_states", [False, True])
def test_the_scan_equals_upstreams_kernel_at_every_length(with_states: bool) -> None:
    module = _Scan(with_states).eval()
    length = torch.export.Dim("length", min=2, max=512)
    batch = torch.export.Dim("batch", min=1, max=64)
    sequence = {0: batch, 2: length}
    shapes = (sequence, sequence, sequence, sequence, sequence, {0: batch}, {0: batch}, {0: batch})
    with torch.no_grad():
        program = torch.export.export(module, _inputs(2, 7), dynamic_shapes=shapes)
        for batch_size, tokens in ((2, 7), (2, 2), (3, 3), (1, 4), (2, 5), (2, 13), (1, 73)):
            inputs = _inputs(batch_size, tokens)
            states = inputs[5:] if with_states else (None, None, None)
            hidden, last = module.backend(*inputs[:5], *states)
            got_hidden, got_last = program.module()(*inputs)
            # Below the chunk size eager runs the same steps in the same order: the same numbers; from it on the
            # chunkwise form of the recurrence, equal to float rounding.
            atol = 0.0 if tokens < CHUNK else 1e-5
            torch.testing.assert_close(got_hidden, hidden, atol=atol, rtol=atol)
            for got, expected in zip(got_last, last, strict=True):
                torch.testing.assert_close(got, expected, atol=atol, rtol=atol)


class _Declines(torch.nn.Module):
    """The replacement's hidden states for a backend of `mode`, or the query where it declines (upstream's own
    path would fix the length): the two differ in their last size (DIM_V, DIM_QK)."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.backend = _backend(mode)

    def forward(self, query, key, value, igate, fgate):
        out = scan_mlstm(type(self.backend).forward, self.backend, query, key, value, igate, fgate)
        return query if out is NOT_APPLICABLE else out[0]


def test_a_concrete_length_and_the_train_mode_are_left_to_upstream() -> None:
    inputs = _inputs(2, 5)[:5]
    inference = _backend()
    assert scan_mlstm(type(inference).forward, inference, *inputs) is NOT_APPLICABLE
    assert scan_mlstm(type(inference).forward, inference, *inputs, mode="train") is NOT_APPLICABLE
    # Under export (a symbolic length) the train mode still declines, the inference mode does not.
    sequence = {2: torch.export.Dim("length", min=2, max=64)}
    for mode, size in (("train", DIM_QK), ("inference", DIM_V)):
        with torch.no_grad():
            program = torch.export.export(_Declines(mode), inputs, dynamic_shapes=(sequence,) * 5)
        assert program.module()(*_inputs(2, 9)[:5]).shape == (2, HEADS, 9, size)
