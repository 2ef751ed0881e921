"""RecurrentGemma: how the patches of its RG-LRU recognise upstream's code, and the example model they share
(`patch/rglru-recurrence-scan`, `patch/rglru-state-in-cache`).

A rule matches a module by its code, not its class name: `function_tree` compares a method's syntax tree (docstring
and decorators aside) with upstream's, so a class whose method is upstream's is patched and any other keeps its own.
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
from hfexport.rewrites.examples import Built
from hfexport.rewrites.rules.patch._scan_site import class_method_at

# transformers 5.24.0 models/recurrent_gemma/modeling_recurrent_gemma.py RecurrentGemmaRglru._rnn_scan (docstring
# left out): the code `patch/rglru-recurrence-scan`'s replacements are exact for. Another body is not matched.
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


def function_tree(source: str) -> str | None:
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


_UPSTREAM_TREE = function_tree(_UPSTREAM)


@functools.cache
def _is_upstream_scan(function: types.FunctionType) -> bool:
    try:
        source = inspect.getsource(inspect.unwrap(function))
    except (OSError, TypeError):
        return False
    return function_tree(source) == _UPSTREAM_TREE


def runs_rglru_loop(module: torch.nn.Module) -> bool:
    """A module whose class's `_rnn_scan` is upstream's RG-LRU recurrence (the Python loop over the tokens)."""
    function = getattr(type(module), "_rnn_scan", None)
    return isinstance(function, types.FunctionType) and _is_upstream_scan(function)


def covers(module: str, scope: str) -> bool:
    """Whether the rule binds to `module.scope` (for `hfexport scan`): a class's `_rnn_scan` that is upstream's."""
    function = class_method_at(module, scope, "_rnn_scan")
    return function is not None and _is_upstream_scan(function)


# What `hfexport scan` (hfexport.apps.scan_rules.RuleIndex) reads off the predicate: the site kind it fixes, and
# `covers`.
runs_rglru_loop.scan_kind = "loop-over-shape"  # type: ignore[attr-defined]
runs_rglru_loop.covers = covers  # type: ignore[attr-defined]


def recurrent_gemma_example(tokens: int, batch: int = 2, **extra: Any) -> Built:
    """A RecurrentGemma causal LM run on `tokens` tokens (a batch of `batch`), its RG-LRUs drawn as if trained."""
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
