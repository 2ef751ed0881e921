"""The code model fixture (`tests/fixtures/code_lm`, made by `tools/train_code_lm.py`): a Llama trained on the
Python stdlib's source, loaded offline with transformers' Auto classes."""

from __future__ import annotations

import json
import math
import platform
from pathlib import Path

import pytest
import torch

from hfexport.artifacts.eval_text import heldout_python, is_heldout, read_stdlib

FIXTURE = Path(__file__).parent / "fixtures" / "code_lm"
METADATA = json.loads((FIXTURE / "training.json").read_text())
# The trained model's perplexity on heldout.txt (training.json: `heldout_txt_perplexity`), with a little room for
# other CPUs' arithmetic; a uniform guess over the 4096 tokens would be 4096.
MAX_PERPLEXITY = METADATA["heldout_txt_perplexity"] * 1.02


@pytest.fixture(scope="module")
def code_lm() -> tuple[torch.nn.Module, object]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(FIXTURE, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(FIXTURE, local_files_only=True)
    return model, tokenizer


def test_fixture_is_a_small_llama_with_its_own_tokenizer(code_lm: tuple[torch.nn.Module, object]) -> None:
    model, tokenizer = code_lm
    config = model.config
    assert config.model_type == "llama" and config.tie_word_embeddings
    assert (config.hidden_size, config.num_attention_heads, config.num_key_value_heads) == (256, 8, 2)
    assert len(tokenizer) == config.vocab_size == 4096
    assert tokenizer.decode(tokenizer("def f(x):\n    return x")["input_ids"]) == "def f(x):\n    return x"
    assert sum(f.stat().st_size for f in FIXTURE.iterdir()) <= 20 * 1024 * 1024
    assert next(model.parameters()).dtype == torch.float32


def _perplexity(model: torch.nn.Module, ids: torch.Tensor) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(ids) - 1, 256):
            piece = ids[start : start + 257]
            logits = model(piece[None, :-1]).logits[0]
            total += torch.nn.functional.cross_entropy(logits, piece[1:], reduction="sum").item()
            count += len(piece) - 1
    return math.exp(total / count)


def test_perplexity_of_the_first_heldout_tokens_is_far_below_uniform(
    code_lm: tuple[torch.nn.Module, object],
) -> None:
    """The first 2048 tokens of heldout.txt (27.4 here; the whole file's 16.9 is the slow test's): a fast check that
    the weights are the trained ones."""
    model, tokenizer = code_lm
    ids = tokenizer((FIXTURE / "heldout.txt").read_text(), return_tensors="pt")["input_ids"][0]
    assert _perplexity(model, ids[: 8 * 256 + 1]) < model.config.vocab_size / 100


@pytest.mark.slow
def test_heldout_perplexity_is_the_recorded_one(code_lm: tuple[torch.nn.Module, object]) -> None:
    model, tokenizer = code_lm
    ids = tokenizer((FIXTURE / "heldout.txt").read_text(), return_tensors="pt")["input_ids"][0]
    perplexity = _perplexity(model, ids)
    assert perplexity < MAX_PERPLEXITY, perplexity
    assert perplexity < model.config.vocab_size / 100


def test_greedy_continuation_is_deterministic_python(code_lm: tuple[torch.nn.Module, object]) -> None:
    model, tokenizer = code_lm
    inputs = tokenizer("import os\n\n\ndef ", return_tensors="pt")
    first = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    second = model.generate(**inputs, max_new_tokens=24, do_sample=False)
    assert torch.equal(first, second)
    text = tokenizer.decode(first[0])
    # A function definition: a name, then its argument list.
    name, paren, _ = text.removeprefix("import os\n\n\ndef ").partition("(")
    assert name.isidentifier() and paren, text


def test_heldout_split_is_the_one_the_fixture_was_trained_on() -> None:
    corpus = read_stdlib(heldout_only=True)
    assert corpus.heldout and not corpus.train
    assert all(is_heldout(name) for name in corpus.heldout)
    if platform.python_version() != METADATA["python"]:
        pytest.skip(
            f"the fixture was trained on Python {METADATA['python']}'s stdlib; this is {platform.python_version()}"
        )
    text, description = heldout_python()
    assert text == (FIXTURE / "heldout.txt").read_text()
    assert METADATA["python"] in description
