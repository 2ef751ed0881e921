"""Config-dependent branch sites (LibCST), the sides a run takes (line counts), and the variants proposed from them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from hfexport.testing.config_branches import branch_sites_of_source, count_lines, sides_taken
from hfexport.testing.corpus_variants import SHORT_WINDOW, Variant, apply_variant, propose_variants

SOURCE = """
class Attention:
    def __init__(self, config, layer_idx):
        self.window = config.sliding_window
        self.is_sliding = config.layer_types[layer_idx] == "sliding_attention"
        if config.q_lora_rank is None:
            self.q = 1

    def forward(self, x):
        if self.is_sliding:
            x = x + 1
        for _ in range(self.config.n_shared_experts):
            x = x * 2
        heads = self.config.hidden_size // self.config.num_attention_heads
        if self.training:
            x = 0
        return x, heads

    def _init_weights(self, module):
        if self.config.tie_word_embeddings:
            pass
"""


def test_sites_are_the_branches_loops_and_divisions_that_read_the_config() -> None:
    sites = {(s.kind, s.line): s for s in branch_sites_of_source(SOURCE)}
    q_lora = sites["if", 6]
    assert q_lora.attrs == ("q_lora_rank",) and q_lora.none_test and q_lora.body == 7
    # `self.is_sliding` stands for the attribute __init__ read it from, with the literal it compares to.
    sliding = sites["if", 10]
    assert sliding.attrs == ("layer_types",) and sliding.literals == ("sliding_attention",)
    assert sites["range", 12].attrs == ("n_shared_experts",)
    assert sites["div", 14].attrs == ("hidden_size", "num_attention_heads")
    # A test on runtime state (`self.training`) and weight initialisation are not config branches.
    assert ("if", 15) not in sites and all(s.scope != "Attention._init_weights" for s in sites.values())


def test_line_counts_tell_which_side_of_an_if_ran(tmp_path: Path) -> None:
    path = tmp_path / "branchy.py"
    path.write_text("def f(config):\n    if config.flag:\n        return 1\n    return 0\n")
    spec = importlib.util.spec_from_file_location("branchy", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["branchy"] = module
    spec.loader.exec_module(module)
    site = next(s for s in branch_sites_of_source(path.read_text()) if s.kind == "if")

    class Config:
        flag = True

    true_only = count_lines([str(path)], lambda: module.f(Config()))
    assert sides_taken(site, true_only.counts[str(path.resolve())]) == (True, False)
    Config.flag = False
    both = count_lines([str(path)], lambda: module.f(Config()))
    both.merge(true_only)
    assert sides_taken(site, both.counts[str(path.resolve())]) == (True, True)
    assert sides_taken(site, count_lines([str(path)], lambda: None).counts[str(path.resolve())]) is None


def test_mistral_variants_cross_its_window_and_change_its_attention_layout() -> None:
    config = {
        "model_type": "mistral",
        "hidden_size": 32,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "sliding_window": 16,
        "tie_word_embeddings": False,
    }
    names = [v.name for v in propose_variants("mistral", config)]
    assert names[:3] == [f"sliding_window={SHORT_WINDOW}", "sliding_window=12", "sliding_window=none"]
    assert {"num_key_value_heads=2", "head_dim=8", "tie_word_embeddings=true"} <= set(names)


def test_a_variant_sets_the_attribute_where_the_config_tree_has_it() -> None:
    entry = {
        "model_type": "x",
        "source": "generated:shrink-level-0",
        "n_params": 10,
        "config": {"model_type": "x", "text_config": {"model_type": "y", "sliding_window": 16}},
    }
    out = apply_variant(entry, Variant("sliding_window=3", (("sliding_window", 3),), "short"))
    assert out["config"]["text_config"]["sliding_window"] == 3 and "sliding_window" not in out["config"]
    assert out["variant"] == "sliding_window=3" and "n_params" not in out
    assert entry["config"]["text_config"]["sliding_window"] == 16  # the entry itself is untouched


def test_the_variants_readme_sums_the_sides_each_type_takes(tmp_path: Path) -> None:
    import json

    from hfexport.testing.corpus_readmes import write_variants_readme

    (tmp_path / "fam").mkdir()
    coverage = {
        "a": {
            "if_sites": 5,
            "reached": 2,
            "sides": 4,
            "covered_by_entry": 2,
            "covered": 3,
            "variants": ["x=1"],
            "skipped": {"y=0": "ValueError: no"},
            "uncovered": [],
        },
        "b": {"error": "timeout: no result within 600s"},
    }
    (tmp_path / "fam" / "_coverage.json").write_text(json.dumps(coverage))
    totals = write_variants_readme(tmp_path, "fam")
    assert (totals["types"], totals["measured"], totals["variants"], totals["not_built"]) == (2, 1, 1, 1)
    text = (tmp_path / "fam" / "README.md").read_text()
    assert "| a | 1 | 5 (2) | 2/4 | 3/4 | y=0: ValueError: no |" in text
    assert "| b | - | - | - | - | timeout: no result within 600s |" in text
