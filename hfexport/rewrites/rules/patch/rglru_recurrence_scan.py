"""RecurrentGemma's RG-LRU recurrence (`_rnn_scan`) as a `scan` higher-order op.

`RecurrentGemmaRglru._rnn_scan` runs the linear recurrence `h_t = a_t * h_{t-1} + x_t` in "linear mode" (more
than one token) as `for t in range(hidden_states.shape[1])`, which torch.export unrolls: the prefill program
exported from an 8-token prompt fails `Guard failed: input_ids.size()[1] == 8` on any other length (the corpus'
causal_lm/recurrent_gemma on Dynamo; its ONNX model inherits the fixed axis). `torch._higher_order_ops.scan` traces
the loop body once with a symbolic length; every step does upstream's operations in upstream's order and dtypes
(the gate and the input cast to the float32 accumulator, the output row cast back to the input's dtype), so the
numbers are those of eager. The reset at segment starts (position 0) is upstream's `recurrent_gate * ~reset`,
computed before the loop as upstream does; the returned state is the scan's final carry, as upstream returns its
last `recurrent_states`.

The rule matches a module by its code, not its class name: a class whose `_rnn_scan` is upstream's (the same
syntax tree, docstring aside: `_UPSTREAM` below) is patched; any other `_rnn_scan` keeps its own. A single token
(the decode step) and any concrete length (a static export) are declined: the original's one step or unrolled loop
is exact there.

`hfexport scan` over transformers 5.24 finds this loop (`loop-over-shape` in `_rnn_scan`) in recurrent_gemma only. The
other untargeted per-token loops it lists are other recurrences, not copies: `recurrent_kimi_delta_attention`
(bailing_hybrid, glm5_next, kimi_linear), `torch_recurrent_gated_delta_rule` (lara_mini, olmo_hybrid, qwen3_5,
qwen3_5_moe, qwen3_next, qwen4_exp), MiniMaxLightningAttention.forward and xlstm's
`mlstm_recurrent_sequence_native`.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
import types
from typing import Any

import torch

from hfexport.rewrites.example_models import tiny_model
from hfexport.rewrites.examples import Built, Match, NoMatch
from hfexport.rewrites.kinds.patch import NOT_APPLICABLE, MethodPatch
from hfexport.rewrites.rule import RuleMeta
from hfexport.rewrites.rules.patch._scan_site import class_method_at

# transformers 5.24.0 models/recurrent_gemma/modeling_recurrent_gemma.py RecurrentGemmaRglru._rnn_scan (docstring
# left out): the code this rule's replacement is exact for. A method with another body is not matched.
_UPSTREAM = """
def _rnn_scan(
    self,
    hidden_states: torch.Tensor,
    recurrent_gate: torch.Tensor,
    reset: torch.Tensor,
    recurrent_states: torch.Tensor | None,
    acc_dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    # Multiply `a` by the reset.
    recurrent_gate = recurrent_gate * ~reset

    if hidden_states.shape[1] == 1:
        # Using scan in sampling mode.
        if recurrent_states is None:  # same here, when decoding you always have cache
            return hidden_states, hidden_states[:, 0].type(acc_dtype)

        else:
            contextualized_states = recurrent_gate.type(acc_dtype) * recurrent_states[:, None].to(
                recurrent_gate.device
            )
            contextualized_states += hidden_states.type(acc_dtype)
            return contextualized_states.type(hidden_states.dtype), contextualized_states[:, -1]

    else:
        # Using scan in linear mode.
        if recurrent_states is None:
            recurrent_states = torch.zeros(hidden_states[:, 0].shape, dtype=acc_dtype, device=hidden_states.device)

        contextualized_states = torch.zeros_like(hidden_states)
        for t in range(hidden_states.shape[1]):
            recurrent_states = recurrent_gate[:, t].type(acc_dtype) * recurrent_states.to(recurrent_gate.device)
            recurrent_states = recurrent_states + hidden_states[:, t].type(acc_dtype)
            contextualized_states[:, t] = recurrent_states.type(hidden_states.dtype)

    return contextualized_states, recurrent_states
"""


def _tree(source: str) -> str | None:
    """The syntax tree of one function definition without its docstring (comments and layout never count)."""
    try:
        module = ast.parse(textwrap.dedent(source))
    except SyntaxError:
        return None
    if len(module.body) != 1 or not isinstance(module.body[0], ast.FunctionDef):
        return None
    function = module.body[0]
    first = function.body[0] if function.body else None
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        function.body = function.body[1:]
    function.decorator_list = []
    return ast.dump(function)


_UPSTREAM_TREE = _tree(_UPSTREAM)


@functools.cache
def _is_upstream_scan(function: types.FunctionType) -> bool:
    try:
        source = inspect.getsource(inspect.unwrap(function))
    except (OSError, TypeError):
        return False
    return _tree(source) == _UPSTREAM_TREE


def runs_rglru_loop(module: torch.nn.Module) -> bool:
    """A module whose class's `_rnn_scan` is upstream's RG-LRU recurrence (the Python loop over the tokens)."""
    function = getattr(type(module), "_rnn_scan", None)
    return isinstance(function, types.FunctionType) and _is_upstream_scan(function)


def covers(module: str, scope: str) -> bool:
    """Whether the rule binds to `module.scope` (for `hfexport scan`): a class's `_rnn_scan` that is upstream's."""
    function = class_method_at(module, scope, "_rnn_scan")
    return function is not None and _is_upstream_scan(function)


# What `hfexport scan` (hfexport.scan.RuleIndex) reads off the predicate: the site kind it fixes, and `covers`.
runs_rglru_loop.scan_kind = "loop-over-shape"  # type: ignore[attr-defined]
runs_rglru_loop.covers = covers  # type: ignore[attr-defined]


def initial_state(
    hidden_states: torch.Tensor,
    recurrent_gate: torch.Tensor,
    reset: torch.Tensor,
    recurrent_states: torch.Tensor | None,
    acc_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The reset gate and the loop's starting state, as upstream's `_rnn_scan` prepares them (shared with
    patch/rglru-recurrence-openvino)."""
    # Upstream's order: the reset first, then (more than one token) the state, zero when there is none.
    recurrent_gate = recurrent_gate * ~reset
    if recurrent_states is None:
        recurrent_states = torch.zeros(hidden_states[:, 0].shape, dtype=acc_dtype, device=hidden_states.device)
    # The carry keeps its dtype at every step (a loop carry must): upstream's state is acc_dtype throughout, or,
    # for a given state of a wider dtype, the promotion of both from its first step on (`.type(acc_dtype) *` it).
    state = recurrent_states.to(recurrent_gate.device)
    return recurrent_gate, state.to(torch.promote_types(acc_dtype, state.dtype))


def scan_rnn(
    original: Any,
    self: torch.nn.Module,
    hidden_states: torch.Tensor,
    recurrent_gate: torch.Tensor,
    reset: torch.Tensor,
    recurrent_states: torch.Tensor | None,
    acc_dtype: torch.dtype = torch.float32,
) -> Any:
    """Upstream's linear mode, scanned over the sequence axis (a symbolic length only)."""
    if not isinstance(hidden_states.shape[1], torch.SymInt):
        return NOT_APPLICABLE
    from torch._higher_order_ops.scan import scan

    recurrent_gate, init = initial_state(hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype)
    out_dtype = hidden_states.dtype

    def step(state: torch.Tensor, xs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        gate, inputs = xs
        state = gate.type(acc_dtype) * state
        state = state + inputs.type(acc_dtype)
        # Upstream's output row is `state.type(hidden_states.dtype)`; a copy, since a scan's output may not alias
        # its carry (when the dtypes are the same `.type` returns the state itself). The values are the same.
        return state, state.to(out_dtype, copy=True)

    # A copy made in the trace: a state the module kept from an earlier eager call is a real tensor, which the
    # scan cannot take as its carry ("Cannot access data pointer of Tensor" in generation's prefill).
    init = init.clone(memory_format=torch.contiguous_format)
    # Not detached (unlike patch/mamba-selective-scan-onnx): torch.onnx's type promotion passes this scan, as it
    # does RWKV's (the ONNX example and the corpus model export and run in ORT without a detach).
    state, outputs = scan(step, init, (recurrent_gate.movedim(1, 0), hidden_states.movedim(1, 0)))
    return outputs.movedim(0, 1), state


def _recurrent_gemma(tokens: int, batch: int = 2, **extra: Any) -> Built:
    # One recurrent block then one attention block (the corpus' layout), lru_width 32 over 2 heads.
    model, inputs = tiny_model(
        "RecurrentGemmaConfig",
        "RecurrentGemmaForCausalLM",
        tokens=tokens,
        batch=batch,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=16,
        lru_width=32,
        conv1d_width=4,
        attention_window_size=2048,
        block_types=["recurrent", "attention"],
    )
    trained_looking_rglru(model)
    return model, {**inputs, **extra}


def trained_looking_rglru(model: torch.nn.Module) -> None:
    """Draw every RG-LRU's parameters (seed 1, scale 0.5): random gates and a decay that keeps the recurrence far
    from 0 and 1, where the default init leaves the state nearly unused."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for module in model.modules():
            if runs_rglru_loop(module):
                for parameter in module.parameters():
                    parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)


def _positions(batch: int, tokens: int, restart: int) -> torch.Tensor:
    # Two segments in one row: positions restart at 0 at `restart`, where upstream resets the recurrence.
    positions = torch.arange(tokens).repeat(batch, 1)
    positions[0, restart:] = torch.arange(tokens - restart)
    return positions


EXAMPLES = (
    Match(
        lambda: _recurrent_gemma(7, use_cache=True),
        "recurrent_gemma causal LM (its state set up: use_cache), odd length, then 13 tokens and another batch",
        atol=1e-5,
        rtol=1e-5,
        other_inputs=lambda: {"input_ids": torch.randint(0, 64, (3, 13)), "use_cache": True},
    ),
    Match(
        lambda: _recurrent_gemma(9, use_cache=False, position_ids=_positions(2, 9, 4)),
        "no cache (no initial state) and a second segment in the first row: the recurrence resets at position 0",
        atol=1e-5,
        rtol=1e-5,
        other_inputs=lambda: {
            "input_ids": torch.randint(0, 64, (3, 16)),
            "use_cache": False,
            "position_ids": _positions(3, 16, 11),
        },
    ),
    NoMatch(
        lambda: _recurrent_gemma(1),
        "a single token (a decode step)",
        reason="the replacement declines a concrete length: upstream's one-token step is exact",
    ),
)


rglru_recurrence_scan = MethodPatch(
    RuleMeta(
        id="patch/rglru-recurrence-scan",
        why="RecurrentGemma exports with the prompt length baked in: the RG-LRU's `_rnn_scan` loops `for t in "
        "range(hidden_states.shape[1])`, which torch.export unrolls, so the prefill program fails 'Guard failed: "
        "input_ids.size()[1] == 8' at 13, 73 and 138 tokens (corpus causal_lm/recurrent_gemma); a scan op keeps "
        "the length symbolic with upstream's per-step arithmetic and dtypes",
        upstream="transformers==5.24.0 models/recurrent_gemma/modeling_recurrent_gemma.py RecurrentGemmaRglru."
        "_rnn_scan (a Python loop over the sequence); torch._higher_order_ops.scan keeps the length symbolic",
        backends=("dynamo", "onnx"),
        models=("recurrent_gemma",),
        examples=EXAMPLES,
    ),
    target=runs_rglru_loop,
    method="_rnn_scan",
    replacement=scan_rnn,
)
