"""A model and a module-level function it calls, for the engine's patch tests."""

import torch


def scale(x: torch.Tensor) -> torch.Tensor:
    return x * 1


class Doubler(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return scale(x) + x
