"""A tied output projection (`tie_word_embeddings`): the example models of the rules for weights that several nodes
read (`onnx/fold-shared-weight-transpose`, `fx/untie-shared-weights`)."""

from __future__ import annotations

import torch


class TiedHead(torch.nn.Module):
    """An embedding whose weight is also the output projection."""

    def __init__(self, vocab: int, hidden: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.norm = torch.nn.LayerNorm(hidden)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(self.norm(self.embed(input_ids)), self.embed.weight)


class UntiedHead(TiedHead):
    """The same with a head of its own: no weight has two readers."""

    def __init__(self, vocab: int, hidden: int = 16) -> None:
        super().__init__(vocab, hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.embed(input_ids)))


def token_ids(vocab: int) -> dict[str, torch.Tensor]:
    """Two rows of five token ids below `vocab`, seeded."""
    return {"input_ids": torch.randint(0, vocab, (2, 5), generator=torch.Generator().manual_seed(0))}
