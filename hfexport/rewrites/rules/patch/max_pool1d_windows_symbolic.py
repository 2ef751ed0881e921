"""`max_pool1d` over non-overlapping windows of a symbolic length, as a reshape and `amax`.

ATen's `max_pool1d` (the no-indices path that `F.max_pool1d` and `nn.MaxPool1d` take under `no_grad`) reads its
input's length as a concrete integer, so torch.export specialises the length to the sample's (`Eq(s, 40)`,
'You marked T as dynamic but your code specialized it to be a constant'). transformers pools attention masks with
it to follow a downsampled sequence: SEW and SEW-D (`max_pool1d(mask, kernel_size=squeeze_factor,
stride=squeeze_factor)` in the encoder) and CANINE (`MaxPool1d(kernel_size=rate, stride=rate)` in
`_downsample_attention_mask`), so their exports accepted the sample's length only.

With the window as long as the stride, no padding, no dilation and `ceil_mode=False`, the windows are the
`L // k` consecutive blocks of `k` elements and the trailing `L % k` elements are dropped: exactly
`x[..., : (L // k) * k].reshape(..., L // k, k).amax(-1)`. `amax` returns the same element as the pool (a NaN in a
window propagates in both); only other pools (overlapping windows, padding, `ceil_mode`, indices) and a
concrete length keep the original. Matched by structure: any model whose modeling source calls `max_pool1d` or
builds `MaxPool1d`.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch
import torch.nn.functional as F

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, ModuleFunctionPatch
from hfexport.rewrites.rule import RuleMeta


def _one(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return value[0] if len(value) == 1 else None
    return value


def max_pool1d(
    original: Any,
    input: torch.Tensor,
    kernel_size: Any,
    stride: Any = None,
    padding: Any = 0,
    dilation: Any = 1,
    ceil_mode: bool = False,
    return_indices: bool = False,
) -> Any:
    """Non-overlapping windows (kernel == stride, no padding or dilation, floor mode) of a symbolic length only."""
    if not isinstance(input, torch.Tensor) or input.ndim not in (2, 3) or not input.is_floating_point():
        return NOT_APPLICABLE
    length = input.shape[-1]
    if not isinstance(length, torch.SymInt) or return_indices or ceil_mode:
        return NOT_APPLICABLE
    kernel = _one(kernel_size)
    step = kernel if stride is None or (isinstance(stride, (tuple, list)) and len(stride) == 0) else _one(stride)
    if not isinstance(kernel, int) or kernel < 1 or step != kernel or _one(padding) != 0 or _one(dilation) != 1:
        return NOT_APPLICABLE
    # Changed: the pool's `(L - k) // k + 1 == L // k` windows as blocks of the first `(L // k) * k` elements.
    windows = length // kernel
    kept = input[..., : windows * kernel]
    return kept.reshape(*input.shape[:-1], windows, kernel).amax(-1)


def _calls_max_pool1d(model: torch.nn.Module) -> bool:
    seen: set[str] = set()
    for module in model.modules():
        if isinstance(module, torch.nn.MaxPool1d):
            return True
        name = type(module).__module__
        if name in seen or not name.startswith("transformers."):
            continue
        seen.add(name)
        source_module = sys.modules.get(name)
        try:
            source = inspect.getsource(source_module) if source_module is not None else ""
        except (OSError, TypeError):
            continue
        if "max_pool1d(" in source or "MaxPool1d(" in source:
            return True
    return False


class _MaskPooling(torch.nn.Module):
    """The pattern of SEW's encoder and CANINE's mask downsampling: a padding mask pooled by a window of `rate`
    (functional and module forms), then used next to features pooled the same way."""

    def __init__(self, rate: int = 4) -> None:
        super().__init__()
        self.rate = rate
        self.pool = torch.nn.MaxPool1d(kernel_size=rate, stride=rate)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mask = F.max_pool1d(attention_mask.float().unsqueeze(1), kernel_size=self.rate, stride=self.rate)
        mask = mask.squeeze(1).long()
        # Real-valued features too (negative values, a tail of L % rate dropped).
        pooled = self.pool(self.proj(hidden).transpose(1, 2)).transpose(1, 2)
        return pooled * mask.unsqueeze(-1).to(pooled.dtype), mask


class _OverlappingPool(torch.nn.Module):
    """Informer's distilling pool: overlapping windows with padding (kernel 3, stride 2, padding 1)."""

    def __init__(self) -> None:
        super().__init__()
        self.pool = torch.nn.MaxPool1d(kernel_size=3, stride=2, padding=1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.pool(hidden.transpose(1, 2)).transpose(1, 2)


def _inputs(length: int, padded: int, seed: int = 0) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    mask = torch.ones(2, length, dtype=torch.long)
    if padded:
        mask[1, -padded:] = 0
    return {"hidden": torch.randn(2, length, 8, generator=generator), "attention_mask": mask}


def _pooling() -> Any:
    torch.manual_seed(0)
    return _MaskPooling(4).eval()


max_pool1d_windows_symbolic = ModuleFunctionPatch(
    RuleMeta(
        id="patch/max-pool1d-windows-symbolic",
        why="SEW/SEW-D CTC and CANINE exported for the sample's length only: ATen's max_pool1d over the attention "
        "mask (kernel == stride) reads the length as a constant (SEW CTC: 'Guard failed: -1 + "
        "input_values.size()[1] // 10 == 101' at modeling_sew.py:433; CANINE: guard Eq(s, 8))",
        upstream="torch==2.13.0 aten max_pool1d (ATen/native/MaxPooling.cpp, concrete sizes); callers "
        "transformers==5.24.0 models/sew/modeling_sew.py SEWEncoder.forward, models/sew_d/modeling_sew_d.py "
        "SEWDTransformerEncoder.forward, models/canine/modeling_canine.py CanineModel._downsample_attention_mask",
        models=("sew", "sew-d", "canine"),
        examples=(
            Match(
                lambda: (_pooling(), _inputs(37, padded=9)),
                "a padded mask and features of 37 frames pooled by 4 (one frame dropped), then 50 frames",
                other_inputs=lambda: _inputs(50, padded=0, seed=1),
            ),
            NoMatch(
                lambda: (_OverlappingPool().eval(), {"hidden": torch.randn(2, 37, 8)}),
                "overlapping windows with padding (kernel 3, stride 2, padding 1: Informer's distilling pool)",
                reason="the window differs from the stride: not consecutive blocks",
            ),
            NoMatch(
                lambda: (_pooling(), _inputs(37, padded=9)),
                "the mask pooling exported static",
                reason="a concrete length: the original's sizes are exact",
            ),
        ),
    ),
    target="torch.nn.functional.max_pool1d",
    replacement=max_pool1d,
    applies=_calls_max_pool1d,
)
