"""How the ExecuTorch runtime is fed: strided views copied before `execute`, and a saved component's input order
rebuilt from the generation layout (an encoder-decoder's `encoder_outputs` by its recorded fields)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip("executorch")

from hfexport.core.errors import InputError
from hfexport.generation_spec import ComponentSpec, GenerationSpec


class _Scaled(torch.nn.Module):
    def forward(self, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        return hidden * 2 + ids[..., None].float()


@pytest.fixture(scope="module")
def program() -> Any:
    """A two-input program lowered to XNNPACK, opened in the ExecuTorch runtime."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    from hfexport.runtime.executorch import ExecutorchProgram

    sample = {"ids": torch.ones(2, 3, dtype=torch.long), "hidden": torch.zeros(2, 3, 4)}
    exported = torch.export.export(_Scaled(), (), sample)
    manager = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()]).to_executorch()
    return ExecutorchProgram(manager)


def test_a_strided_view_is_fed_as_its_copy(program: Any) -> None:
    """The runtime refuses a view whose strides are not its dim order's (LLaVA's projector input is the model's
    `hidden_states[:, 1:]`); `run` and the generation driver feed such a view as a contiguous copy."""
    from hfexport.runtime.executorch import contiguous

    ids = torch.arange(6).reshape(2, 3)
    hidden = torch.randn(2, 4, 4, generator=torch.Generator().manual_seed(0))[:, 1:]
    assert not hidden.is_contiguous()
    with pytest.raises(RuntimeError, match="contiguous"):
        program.method.execute([ids, hidden])
    (got,) = program.run({"ids": ids, "hidden": hidden})
    torch.testing.assert_close(got, _Scaled()(ids, hidden))
    fed = contiguous([ids, hidden, None])
    assert fed[0] is ids and fed[1].is_contiguous() and torch.equal(fed[1], hidden) and fed[2] is None


def _spec(
    inputs: list[str], fields: list[str], encoder_decoder: bool = True, leaves: dict[str, list[str]] | None = None
) -> GenerationSpec:
    component = ComponentSpec(inputs=inputs, constants={}, mask_rank=None, cache_leaves=[], leaves=leaves or {})
    return GenerationSpec(
        components={"decode": component},
        cache_key=None,
        static_cache=False,
        max_cache_len=None,
        multi_token_decode=False,
        sample_batch=2,
        is_encoder_decoder=encoder_decoder,
        encoder_output_fields=fields,
    )


def test_a_saved_component_takes_nested_inputs_by_their_recorded_leaf_names(program: Any) -> None:
    """A nested input of a saved component is placed by the flat names of its tensors the layout records, as
    `generate` names what it feeds (`mm_encoder_outputs.image.pooler_output.0`); a layout without them places
    `encoder_outputs` as `encoder_outputs.<field>` (or `.0` for a tuple), not `encoder_outputs`, which no value
    has (T5 and Whisper were fed None)."""
    from hfexport.backends.executorch.driver import _saved_order

    method = program.method
    nested = {"mm_encoder_outputs": ["mm_encoder_outputs.image.pooler_output.0"]}
    order = _saved_order(_spec(["input_ids", "mm_encoder_outputs"], [], False, nested), "decode", method)
    assert [name for name, _ in order] == ["input_ids", "mm_encoder_outputs.image.pooler_output.0"]
    order = _saved_order(_spec(["decoder_input_ids", "encoder_outputs"], ["last_hidden_state"]), "decode", method)
    assert [name for name, _ in order] == ["decoder_input_ids", "encoder_outputs.last_hidden_state"]
    order = _saved_order(_spec(["decoder_input_ids", "encoder_outputs"], []), "decode", method)
    assert [name for name, _ in order] == ["decoder_input_ids", "encoder_outputs.0"]
    # Fields the program does not take as many inputs: refused by count, never fed in a guessed order.
    with pytest.raises(InputError, match="takes 2 inputs; its generation layout names 3"):
        _saved_order(_spec(["decoder_input_ids", "encoder_outputs"], ["last_hidden_state", "mask"]), "decode", method)
