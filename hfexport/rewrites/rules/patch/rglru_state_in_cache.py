"""RecurrentGemma's recurrent-block state (the conv window and the RG-LRU state) carried in the generation cache.

`RecurrentGemmaRecurrentBlock` keeps its state on the module: `self.conv1d_state` (the last `conv1d_width - 1`
conv inputs) and `self.rg_lru.recurrent_states` (the RG-LRU's `h`), set by the prefill and read and replaced by
every decode step. transformers 5.24's generate hands the forward a `DynamicCache` whose recurrent layers are
`LinearAttentionLayer`s, but the model never writes them (and returns a `CausalLMOutput`, without the cache). An
exported program is a function of its inputs: the decode program would read the state as whatever tensor the
module held at trace time (a constant of the sample), and the prefill's state was lost, so generation failed
(`decode takes 'past_key_values.layers_1_keys'` on ONNX, the same on Dynamo: corpus causal_lm/recurrent_gemma).

The replacement wraps the model's forward (the module whose `layers` hold such blocks) and moves the state, it
does not compute anything: before the call each block gets the state of its layer of the cache
(`conv_states[0]`, `recurrent_states[0]` of `cache.layers[i]`), or none when that layer holds none yet (the
prefill: upstream then starts from zeros, as `_setup_cache` makes them); upstream's own forward runs; after it the
block's new state goes into the cache layer, and the module gets back what it held before. So the state is a
graph input and output like Mamba's (the cache pytree carries a `LinearAttentionLayer`'s tensors), every number is
upstream's, and the module is left as it was. `FixedArguments` returns the cache the forward was handed (the
`CausalLMOutputWithPast` twin of its output).

The rule is also installed while `decompose_for_generation` records generate's calls (`records=True`): only then
does the recorded decode step's cache hold the state the decode program takes. It matches by code, not by class
name: a block whose class's `forward` is upstream's, and whose `rg_lru`'s is upstream's RG-LRU (the syntax trees
of `_UPSTREAM_FORWARD` and `_UPSTREAM_RGLRU_FORWARD`, docstrings aside). It declines a call without a cache, with
`use_cache=False`, or whose cache has no linear-attention layer at a block's index. Of transformers 5.24's modeling
files, five assign a `self.<...>state(s)` attribute (decision_transformer, moshi, omdet_turbo, recurrent_gemma,
xlstm); `hfexport scan` of those (kind `state-on-module`: such an assignment in a `forward`) finds it in
recurrent_gemma only (five sites, all in the two forwards above); the others set theirs outside a forward (in
`__init__`, xlstm's cache object `xLSTMCache.__init__`/`reset`, moshi's `_update_model_kwargs_for_generation`).
"""

from __future__ import annotations

import functools
import inspect
import types
from typing import Any

import torch

from hfexport.rewrites.examples import Built, Match, NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, MethodPatch
from hfexport.rewrites.rule import RuleMeta, ScanCause
from hfexport.rewrites.rules.patch._recurrent_gemma import function_tree, recurrent_gemma_example
from hfexport.rewrites.rules.patch._scan_site import class_method_at

# transformers 5.24.0 models/recurrent_gemma/modeling_recurrent_gemma.py RecurrentGemmaRecurrentBlock.forward: the
# code whose state this rule relocates. A block with another forward is not matched.
_UPSTREAM_FORWARD = """
def forward(
    self,
    input_states: torch.Tensor,
    position_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    use_cache: bool = True,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    _, seq_len, _ = input_states.shape
    batch_size = input_states.shape[0]

    y_branch = self.linear_y(input_states)
    y_branch = self.act_fn(y_branch)

    x_branch = self.linear_x(input_states)
    x_branch = x_branch.transpose(1, 2)

    if use_cache:
        # Check if cache needs initialization (None or batch size mismatch)
        if self.conv1d_state is None or self.conv1d_state.shape[0] != batch_size:
            self.conv1d_state = torch.zeros(
                (batch_size, self.hidden_size, self.conv1d_width - 1),
                device=input_states.device,
                dtype=input_states.dtype,
            )
            self.rg_lru.recurrent_states = torch.zeros(
                (batch_size, self.lru_width), device=input_states.device, dtype=torch.float32
            )

        if position_ids.shape[1] != 1:  # prefill
            self.conv1d_state = nn.functional.pad(x_branch, (self.conv1d_width - x_branch.shape[-1] - 1, 0))
            x_branch = self.conv_1d(x_branch)[..., :seq_len]
        else:  # decoding
            conv_state = torch.cat((self.conv1d_state, x_branch), -1)
            x_branch = torch.sum(conv_state * self.conv_1d.weight[:, 0, :], dim=-1) + self.conv_1d.bias
            x_branch = x_branch.unsqueeze(-1)
            self.conv1d_state = conv_state[:, :, 1:]
    else:
        self.conv1d_state = None
        self.rg_lru.recurrent_states = None
        x_branch = self.conv_1d(x_branch)[..., :seq_len]

    x_branch = self.rg_lru(x_branch.transpose(1, 2), position_ids)

    hidden_states = x_branch * y_branch
    hidden_states = self.linear_out(hidden_states)
    return hidden_states, None

"""

# RecurrentGemmaRglru.forward, the block's `rg_lru`: reads `self.recurrent_states` and stores the new state there.
_UPSTREAM_RGLRU_FORWARD = """
def forward(
    self,
    activations: torch.Tensor,
    position_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch_size, seq_len, lru_width = activations.shape
    reset = position_ids[:, :, None] == 0

    reshape_act = activations.reshape(batch_size * seq_len, self.num_attention_heads, self.block_width)
    reshape_act = reshape_act.permute(1, 0, 2)

    res = torch.baddbmm(self.input_gate_bias[:, None, :], reshape_act, self.input_gate_weight)
    input_gate = torch.sigmoid(res.transpose(0, 1).reshape(batch_size, seq_len, lru_width))

    res = torch.baddbmm(self.recurrent_gate_bias[:, None, :], reshape_act, self.recurrent_gate_weight)
    recurrent_gate = torch.sigmoid(res.transpose(0, 1).reshape(batch_size, seq_len, lru_width))

    # Compute the parameter `A` of the recurrence.
    log_recurrent_gate = -8.0 * recurrent_gate * nn.functional.softplus(self.recurrent_param)
    recurrent_gate = torch.exp(log_recurrent_gate)
    a_square = torch.exp(2 * log_recurrent_gate)

    # Gate the input.
    gated_inputs = activations * input_gate

    # Apply gamma normalization to the input. We need to clip the derivatives of
    # `sqrt` in order to prevent NaNs during training in bfloat16. TODO a bit annoying
    multiplier = SqrtBoundDerivative.apply(1 - a_square)
    multiplier = reset + ~reset * multiplier
    normalized_x = gated_inputs * multiplier.type(activations.dtype)

    hidden_states, recurrent_states = self._rnn_scan(
        hidden_states=normalized_x,
        recurrent_gate=recurrent_gate,
        reset=reset,
        recurrent_states=self.recurrent_states,
    )
    self.recurrent_states = recurrent_states
    return hidden_states
"""

_UPSTREAM_TREES = (function_tree(_UPSTREAM_FORWARD), function_tree(_UPSTREAM_RGLRU_FORWARD))


@functools.cache
def _upstream_index(function: types.FunctionType) -> int | None:
    """0 for upstream's block forward, 1 for upstream's RG-LRU forward, None for any other function."""
    try:
        source = inspect.getsource(inspect.unwrap(function))
    except (OSError, TypeError):
        return None
    tree = function_tree(source)
    return _UPSTREAM_TREES.index(tree) if tree in _UPSTREAM_TREES else None


def _runs(module: Any, index: int) -> bool:
    function = getattr(type(module), "forward", None)
    return isinstance(function, types.FunctionType) and _upstream_index(function) == index


def keeps_state_on_module(module: torch.nn.Module) -> bool:
    """A recurrent block whose class's `forward` is upstream's RecurrentGemma block, and its `rg_lru`'s upstream's
    RG-LRU: the two modules that keep the state."""
    return _runs(module, 0) and _runs(getattr(module, "rg_lru", None), 1)


def _blocks(model: torch.nn.Module) -> list[tuple[int, torch.nn.Module]]:
    """`(i, block)` for each layer `i` of `model.layers` with such a block among its direct children."""
    layers = model.__dict__.get("_modules", {}).get("layers")
    if not isinstance(layers, torch.nn.ModuleList):
        return []
    found = []
    for index, layer in enumerate(layers):
        block = next((child for child in layer.children() if keeps_state_on_module(child)), None)
        if block is not None:
            found.append((index, block))
    return found


def runs_stateful_blocks(module: torch.nn.Module) -> bool:
    """A model whose `layers` hold recurrent blocks that keep their state on the module."""
    return bool(_blocks(module))


def covers(module: str, scope: str) -> bool:
    """Whether the rule binds to `module.scope` (for `hfexport scan`): a class's `forward` that is upstream's block
    or RG-LRU, whose states the rule moves."""
    function = class_method_at(module, scope, "forward")
    return function is not None and _upstream_index(function) is not None


runs_stateful_blocks.scan_kind = "state-on-module"  # type: ignore[attr-defined]
runs_stateful_blocks.covers = covers  # type: ignore[attr-defined]


def _linear_layer(cache: Any, index: int) -> Any:
    from transformers.cache_utils import LinearAttentionCacheLayerMixin

    layers = getattr(cache, "layers", None)
    if layers is None or index >= len(layers) or not isinstance(layers[index], LinearAttentionCacheLayerMixin):
        return None
    return layers[index]


def state_in_cache(original: Any, self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Upstream's forward with each block's state taken from, and put back into, its layer of the cache."""
    cache = kwargs.get("cache", kwargs.get("past_key_values"))
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(getattr(self, "config", None), "use_cache", False)
    if args or cache is None or not use_cache:
        return NOT_APPLICABLE
    blocks = [(block, _linear_layer(cache, index)) for index, block in _blocks(self)]
    if not blocks or any(layer is None for _, layer in blocks):
        return NOT_APPLICABLE
    kept = [(block.conv1d_state, block.rg_lru.recurrent_states) for block, _ in blocks]
    for block, layer in blocks:
        held = layer.is_conv_states_initialized[0] and layer.is_recurrent_states_initialized[0]
        # None before the first call: upstream's forward then starts from zeros (`_setup_cache`'s state).
        block.conv1d_state = layer.conv_states[0] if held else None
        block.rg_lru.recurrent_states = layer.recurrent_states[0] if held else None
    try:
        out = original(**kwargs)
        states = [(block.conv1d_state, block.rg_lru.recurrent_states) for block, _ in blocks]
    finally:
        for (block, _), (conv, recurrent) in zip(blocks, kept, strict=True):
            block.conv1d_state, block.rg_lru.recurrent_states = conv, recurrent
    for (block, layer), (conv, recurrent) in zip(blocks, states, strict=True):
        if conv is None or recurrent is None:
            continue
        # The layer as `LinearAttentionLayer.update_*` leaves it after a prefill (without its in-place copies).
        layer.conv_states[0], layer.recurrent_states[0] = conv, recurrent
        layer.is_conv_states_initialized[0] = layer.is_recurrent_states_initialized[0] = True
        layer.has_previous_state[0] = True
        layer.conv_kernel_size[0] = block.conv1d_width - 1
        layer.dtype, layer.device = conv.dtype, conv.device
    return out


class _Steps(torch.nn.Module):
    """A RecurrentGemma causal LM run as generate runs it: a prefill on a fresh cache, then one token per step;
    returns every step's logits (the state flows from step to step through the module, or the cache)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model
        self.config = model.config

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        from transformers.cache_utils import DynamicCache

        cache = DynamicCache(config=self.model.config)
        positions = (attention_mask.cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
        logits = [
            self.model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, cache=cache, use_cache=True
            ).logits
        ]
        mask, last = attention_mask, positions[:, -1:]
        for step in range(next_ids.shape[1]):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=-1)
            last = last + 1
            out = self.model(
                input_ids=next_ids[:, step : step + 1],
                attention_mask=mask,
                position_ids=last,
                cache=cache,
                use_cache=True,
            )
            logits.append(out.logits)
        return torch.cat(logits, dim=1)


def _steps(tokens: int, steps: int, pad: int) -> Built:
    model, inputs = recurrent_gemma_example(tokens)
    mask = torch.ones_like(inputs["input_ids"])
    mask[1, :pad] = 0  # left padding on the second row, as a padded generate prompt
    next_ids = torch.randint(3, 64, (inputs["input_ids"].shape[0], steps), generator=torch.Generator().manual_seed(2))
    return _Steps(model).eval(), {"input_ids": inputs["input_ids"], "attention_mask": mask, "next_ids": next_ids}


def _no_cache(tokens: int) -> Built:
    model, inputs = recurrent_gemma_example(tokens, use_cache=False)
    return model, inputs


EXAMPLES = (
    Match(
        lambda: _steps(7, 3, 2),
        "a left-padded prefill of 7 tokens then 3 one-token steps on one DynamicCache: the state goes through the "
        "cache's linear-attention layer instead of the module",
        atol=1e-5,
        rtol=1e-5,
        known_failure={
            "executorch": "the runtime refuses upstream's prefill conv window `pad(x_branch, (conv1d_width - L - 1, "
            "0))`, a negative pad for a prompt longer than the window (pad[0] = -4, aten::constant_pad_nd.out 0x12), "
            "which the block runs with or without the rule: an ExecuTorch coverage gap of RecurrentGemma (#17)",
            "openvino": "convert_model fails on the attention layer's first cache update in the example's graph "
            "(aten.cat of the DynamicLayer's empty initial keys f32[0] with [2, 2, 7, 16]: 'is_axis_valid'), not on "
            "the state the rule moves: the example builds its cache inside the graph",
        },
    ),
    NoMatch(
        lambda: _no_cache(6),
        "the causal LM without a cache (use_cache=False)",
        reason="declined: no cache to carry the state (upstream drops it too)",
    ),
)


rglru_state_in_cache = MethodPatch(
    RuleMeta(
        id="patch/rglru-state-in-cache",
        why="RecurrentGemma's recurrent blocks keep their conv window and RG-LRU state on the module "
        "(`self.conv1d_state`, `self.rg_lru.recurrent_states`), not in the cache generate hands them, so the "
        "exported prefill drops the state and the decode program has it as a traced constant: generation failed "
        "`decode takes 'past_key_values.layers_1_keys'` (corpus causal_lm/recurrent_gemma, ONNX and Dynamo); the "
        "state now goes through the cache's linear-attention layers, upstream's forward unchanged",
        upstream="transformers==5.24.0 models/recurrent_gemma/modeling_recurrent_gemma.py RecurrentGemmaRecurrentBlock."
        "forward and RecurrentGemmaRglru.forward (state kept on the module; the DynamicCache's LinearAttentionLayer "
        "for those layers stays empty)",
        needed="the need is across programs (prefill, then decode): "
        "tests/test_generation_recurrent_gemma.py::test_recurrent_gemma_generation_needs_the_rule exports for "
        "generation without the rule, and its tokens are not eager's; the Match example is one graph, whose state "
        "flows without it",
        scan=(
            ScanCause(
                "state-kept-on-module",
                "state-on-module",
                r".*\.forward",
                "a forward keeps its generation state on the module (RecurrentGemma's conv window and RG-LRU state), "
                "outside the cache: the exported decode step can neither take it nor return it",
            ),
        ),
        models=("recurrent_gemma",),
        examples=EXAMPLES,
    ),
    target=runs_stateful_blocks,
    method="forward",
    replacement=state_in_cache,
    records=True,
)
