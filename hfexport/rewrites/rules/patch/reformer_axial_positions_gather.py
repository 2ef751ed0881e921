"""Reformer: axial position encodings selected per row by a Python loop over the batch.

`AxialPositionEmbeddings.forward` (modeling_reformer.py) ends its inference path with
`torch.cat([torch.index_select(position_encodings[i], 0, position_ids[i]).unsqueeze(0) for i in
range(batch_size)])`: torch.export unrolls the loop, guards `batch == 2` for a batch-2 sample ("Guard failed:
input_ids.size()[0] == 2" at batch 3 on Dynamo), and ONNX Runtime fails the same way at another batch
("BroadcastIterator::Append axis == 1 || axis == largest" in an Add). Row i of that concatenation is
`position_encodings[i, position_ids[i]]`, which is one `gather` along the sequence axis for every row at once:
the same elements, and an out-of-range id still fails (gather checks its index as index_select does). The
replacement is the original's inference path with that loop replaced; training (its axial-shape check and 2-D
dropout) stays the original.
"""

from __future__ import annotations

from functools import reduce
from operator import mul
from typing import Any

import torch

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, MethodPatch
from hfexport.rewrites.rule import RuleMeta, ScanCause


def forward(original: Any, self: torch.nn.Module, position_ids: torch.Tensor) -> Any:
    if self.training:
        return NOT_APPLICABLE  # the training path never loops over the batch
    from transformers.utils.import_utils import torch_compilable_check

    batch_size, sequence_length = position_ids.shape[0], position_ids.shape[1]
    broadcasted_weights = [
        weight.expand((batch_size, *self.axial_pos_shape, *weight.shape[-1:])) for weight in self.weights
    ]
    if reduce(mul, self.axial_pos_shape) < sequence_length:
        raise ValueError(
            f"Make sure that config.axial_pos_shape factors: {self.axial_pos_shape} multiply at least to "
            f"max(sequence_length, least_common_mult_chunk_length): max({sequence_length}, "
            f"{self.least_common_mult_chunk_length})."
        )
    # The original's column count: only the columns the largest position id reaches.
    max_position_id = position_ids.max().item()
    axial_h, axial_w = self.axial_pos_shape
    torch_compilable_check(max_position_id >= 0, "Axial position id underflow.")
    torch_compilable_check(
        max_position_id < axial_h * axial_w, "Position id exceeds axial_pos_shape[0] * axial_pos_shape[1]."
    )
    required_pos_encodings_columns = (max_position_id + axial_w) // axial_w
    position_encodings = torch.cat([weight[:, :required_pos_encodings_columns] for weight in broadcasted_weights], -1)
    position_encodings = torch.reshape(position_encodings, (batch_size, -1, position_encodings.shape[-1]))
    # Changed: `cat([index_select(pe[i], 0, ids[i]).unsqueeze(0) for i in range(batch)])` as one gather.
    index = position_ids.unsqueeze(-1).expand(-1, -1, position_encodings.shape[-1])
    return torch.gather(position_encodings, 1, index)


class _Positions(torch.nn.Module):
    """Reformer's axial position encodings added to an input, as its embeddings do."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import ReformerConfig
        from transformers.models.reformer.modeling_reformer import AxialPositionEmbeddings

        torch.manual_seed(0)
        config = ReformerConfig(
            hidden_size=12,
            axial_pos_shape=(4, 8),
            axial_pos_embds_dim=(4, 8),
            axial_pos_embds=True,
            hidden_dropout_prob=0,
        )
        self.positions = AxialPositionEmbeddings(config)
        for weight in self.positions.weights:
            torch.nn.init.normal_(weight)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return x + self.positions(position_ids)


def _ids(batch: int, length: int) -> torch.Tensor:
    # Rows with other ids (shifted, as left padding makes them): a loop that reused row 0 would be wrong.
    return torch.stack([torch.arange(length) + 2 * row for row in range(batch)])


def _positions(batch: int = 2, length: int = 11) -> dict[str, Any]:
    return {
        "x": torch.randn(batch, length, 12, generator=torch.Generator().manual_seed(batch)),
        "position_ids": _ids(batch, length),
    }


def _module() -> tuple[torch.nn.Module, dict[str, Any]]:
    return _Positions().eval(), _positions()


class _PlainPositions(torch.nn.Module):
    """Reformer's learned position embeddings (`axial_pos_embds=False`): a lookup, no batch loop."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import ReformerConfig
        from transformers.models.reformer.modeling_reformer import PositionEmbeddings

        torch.manual_seed(0)
        self.positions = PositionEmbeddings(ReformerConfig(hidden_size=12, max_position_embeddings=32))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        return x + self.positions(position_ids)


def _plain() -> tuple[torch.nn.Module, dict[str, Any]]:
    return _PlainPositions().eval(), _positions()


reformer_axial_positions_gather = MethodPatch(
    RuleMeta(
        id="patch/reformer-axial-positions-gather",
        why="Reformer's AxialPositionEmbeddings selects each row's position encodings in a Python loop over the "
        "batch (`for i in range(batch_size)`): the export unrolls it for the sample's batch, so Dynamo guards "
        "'input_ids.size()[0] == 2' and ONNX Runtime fails at another batch (a broadcast error in an Add); one "
        "gather along the sequence axis selects the same elements for every row",
        upstream="transformers==5.24.0 models/reformer/modeling_reformer.py AxialPositionEmbeddings.forward",
        scan=(
            ScanCause(
                "axial-positions-batch-loop",
                "loop-over-shape",
                r"AxialPositionEmbeddings\.forward",
                "a Python loop over the batch selects each row's axial position encodings: the batch is baked in",
            ),
        ),
        models=("reformer",),
        examples=(
            Match(_module, "batch 2, rows with shifted ids", other_inputs=lambda: _positions(3, 7)),
            NoMatch(
                _plain,
                "learned (not axial) position embeddings",
                reason="the replacement declines only training, which an export never traces (it runs in eval "
                "mode): the no-match is a Reformer whose positions are not axial, where the rule is not installed",
                applies=False,
            ),
        ),
    ),
    target="transformers.models.reformer.modeling_reformer.AxialPositionEmbeddings.forward",
    replacement=forward,
)
