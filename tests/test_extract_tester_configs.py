"""`hfexport.testing.tester_extract` (tools/extract_tester_configs.py) reads the values of transformers' model testers,
never running their code."""

from __future__ import annotations

from pathlib import Path

from hfexport.testing.tester_extract import extract

BASE = """
class CausalLMModelTester:
    forced_config_args = ["pad_token_id"]
    config_class = None
    base_model_class = None

    def __init__(self, parent, vocab_size=99, hidden_size=32, num_attention_heads=2, pad_token_id=0, batch_size=13):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.pad_token_id = pad_token_id
        self.batch_size = batch_size
        self.head_dim = self.hidden_size // self.num_attention_heads

    def get_config(self):
        kwarg_names = list(signature(self.config_class.__init__).parameters.keys())
        kwargs = {k: getattr(self, k) for k in kwarg_names + self.forced_config_args if hasattr(self, k)}
        return self.config_class(**kwargs)
"""

LLAMA = """
class LlamaModelTester(CausalLMModelTester):
    if is_torch_available():
        base_model_class = LlamaModel

    def __init__(self, parent, hidden_size=64):
        super().__init__(parent, hidden_size=hidden_size)
        self.num_attention_heads = 4
"""

GPT2 = """
class GPT2ModelTester:
    def __init__(self, parent, n_embd=32, n_layer=2, n_head=4, vocab_size=99, seed=torch.manual_seed(0)):
        self.n_embd = n_embd
        self.n_layer = n_layer
        self.n_head = n_head
        self.vocab_size = vocab_size
        self.extra = {"activation_function": "gelu_new"}

    def get_config(self):
        config = GPT2Config(vocab_size=self.vocab_size, n_embd=self.n_embd, n_layer=self.n_layer * 1,
                            n_head=self.n_head, n_positions=ids_tensor([1], 5), **self.extra)
        config.scale_attn_weights = False
        return config
"""


def test_values_of_a_tester_and_its_base_become_the_config_kwargs(tmp_path: Path) -> None:
    tests = tmp_path / "tests"
    (tests / "models" / "llama").mkdir(parents=True)
    (tests / "models" / "gpt2").mkdir(parents=True)
    (tests / "causal_lm_tester.py").write_text(BASE)
    (tests / "models" / "llama" / "test_modeling_llama.py").write_text(LLAMA)
    (tests / "models" / "gpt2" / "test_modeling_gpt2.py").write_text(GPT2)
    found = extract(tests, "abc123")
    llama = found["llama"][0]
    assert llama["tester"] == "tests/models/llama/test_modeling_llama.py@abc123::LlamaModelTester"
    assert llama["config_class"] == "LlamaConfig"
    # The base's defaults, the subclass's override and its own assignment; only the config's fields (and the
    # forced pad id) are kept: batch_size is the tester's, not the config's.
    assert llama["kwargs"] == {
        "vocab_size": 99,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "pad_token_id": 0,
        "head_dim": 32,  # computed in the base __init__, before the subclass sets 4 heads (as the tester does)
    }
    gpt2 = found["gpt2"][0]
    # `n_positions` is a tensor helper's result: dropped, named; `config.x = v` after the call is applied.
    assert gpt2["kwargs"] == {
        "vocab_size": 99,
        "n_embd": 32,
        "n_layer": 2,
        "n_head": 4,
        "activation_function": "gelu_new",
        "scale_attn_weights": False,
    }
    assert gpt2["dropped"] == ["n_positions"]
