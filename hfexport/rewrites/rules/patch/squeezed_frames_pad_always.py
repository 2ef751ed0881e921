"""SEW/SEW-D: the upsampled frames padded back to the input's frame count without a branch on the count.

The SEW encoders squeeze the frame axis by `squeeze_factor` (an average pool, and the positional conv with that
stride), run the transformer on the short sequence, upsample it by the same factor and then
`if hidden_states.shape[1] < n_input_timesteps: pad(...)` with zeros to the input's frame count. The upsampled
length is `min(pooled, positional) * factor <= (frames // factor) * factor <= frames`, so the branch is taken
exactly when the frame count is not a multiple of the factor (or the positional conv is shorter); torch.export
decides it on the sample and keeps it as a guard (audio classification: 'Guard failed: 2 * min(...) >= 1 + (...)
// 2', the sample's frame count even), so any other remainder was refused.

The replacement runs the original forward with a forward hook on the encoder's `upsample` that pads its output
with zeros to `n_input_timesteps` (a pad of 0 when it is already that long): the same zeros the original adds,
and the original's test is then `n < n`, false by construction, so nothing is guarded. It runs only where the frame
count is symbolic. Matched by structure: a module whose forward pads back to `n_input_timesteps` after its
`upsample` submodule (SEW's and SEW-D's encoders, as `hfexport scan`-style grep finds them in transformers 5.24).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F

from hfexport.rewrites.examples import Match, NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, MethodPatch
from hfexport.rewrites.rule import RuleMeta


def pads_upsampled_frames(module: torch.nn.Module) -> bool:
    """An encoder whose forward pads its `upsample` output back to `n_input_timesteps` under an `if`."""
    if not isinstance(getattr(module, "upsample", None), torch.nn.Module):
        return False
    try:
        source = inspect.getsource(type(module).forward)
    except (OSError, TypeError):
        return False
    return (
        "n_input_timesteps = hidden_states.shape[1]" in source
        and "if hidden_states.shape[1] < n_input_timesteps:" in source
        and "self.upsample(" in source
    )


def padded_forward(original: Any, self: torch.nn.Module, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    frames = hidden_states.shape[1]
    if not isinstance(frames, torch.SymInt):
        return NOT_APPLICABLE  # a concrete count: the original's branch is exact

    def pad_to_frames(_module: torch.nn.Module, _inputs: Any, output: torch.Tensor) -> torch.Tensor:
        # Changed: the original's `if shape[1] < n: pad(..., n - shape[1])`, unconditionally; the upsampled length
        # never exceeds the input's frames (see the module docstring), so the pad is >= 0 (0: unchanged).
        return F.pad(output, (0, 0, 0, frames - output.shape[1]))

    handle = self.upsample.register_forward_hook(pad_to_frames)
    try:
        return original(hidden_states, *args, **kwargs)
    finally:
        handle.remove()


def _audio_classifier(model_type: str) -> Any:
    from transformers import AutoConfig, AutoModelForAudioClassification

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        model_type,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=37,
        conv_dim=(16, 16),
        conv_stride=(5, 2),
        conv_kernel=(10, 3),
        num_conv_pos_embeddings=16,  # even as by default (128): the positional conv is as long as the pool
        num_conv_pos_embedding_groups=2,
        squeeze_factor=2,
        num_labels=3,
    )
    return AutoModelForAudioClassification.from_config(config).eval()


def _waves(samples: int, seed: int = 0) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {"input_values": torch.randn(2, samples, generator=generator)}


# 400 samples: 39 frames after the feature encoder (odd: padded back); 430 samples: 42 frames (even: no pad).
squeezed_frames_pad_always = MethodPatch(
    RuleMeta(
        id="patch/squeezed-frames-pad-always",
        why="SEW and SEW-D audio classifiers exported for the sample's frame parity only: the encoder pads the "
        "upsampled frames back under `if hidden_states.shape[1] < n_input_timesteps` and export guarded the "
        "sample's side ('Guard failed: 2 * min(...) >= 1 + (-1 + (-3 + input_values.size()[1] // 80) // 2) // 2')",
        upstream="transformers==5.24.0 models/sew/modeling_sew.py SEWEncoder.forward, models/sew_d/modeling_sew_d.py "
        "SEWDEncoder.forward (the pad back to n_input_timesteps)",
        # Measured 2026-12-03 on these examples: ExecuTorch refuses the program ('XNNPACK reshape only supports 1
        # dynamic dimension', batch and frames both dynamic) and OpenVINO's conversion fails ('normalize step
        # failed ... slice_shape_inference'); neither is examined yet, so the rule is enabled where it is proven.
        backends=("dynamo", "onnx"),
        models=("sew", "sew-d"),
        examples=(
            Match(
                lambda: (_audio_classifier("sew"), _waves(430)),
                "SEW classifier, 42 frames (even: no pad at the sample), then 39 frames (padded back)",
                other_inputs=lambda: _waves(400, seed=1),
            ),
            Match(
                lambda: (_audio_classifier("sew-d"), _waves(400)),
                "SEW-D classifier, 39 frames (padded back at the sample), then 42 frames",
                other_inputs=lambda: _waves(430, seed=1),
            ),
            NoMatch(
                lambda: (_audio_classifier("sew"), _waves(430)),
                "the SEW classifier exported static",
                reason="a concrete frame count: the original's branch is exact",
            ),
        ),
    ),
    target=pads_upsampled_frames,
    method="forward",
    replacement=padded_forward,
)
