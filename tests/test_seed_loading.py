"""Seed contract: a saved program loads in a fresh process with one call, `register_pytree_node(StaticCache)`.

The seed's Dynamo loop (../shared/seeds/000, "Dynamo" tab) registers the cache class, calls
`torch.export.load`, and reads `.logits` off the loaded module's output; nothing else is set up.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from hfexport import DynamoConfig, DynamoExporter
from hfexport.tiny import get_tiny_model

_LOAD = """
import sys
import torch
import hfexport
from transformers import StaticCache

hfexport.register_pytree_node(StaticCache)
exported = torch.export.load(sys.argv[1])
kwargs = torch.load(sys.argv[2], weights_only=False)
out = exported.module()(**kwargs)
torch.save(out.logits, sys.argv[3])
"""


def test_a_saved_program_with_a_static_cache_loads_with_the_seed_setup(tmp_path: Path) -> None:
    from transformers import StaticCache

    tiny = get_tiny_model("tiny-llama")
    model = tiny.build().eval()
    ids = torch.tensor([[3, 5, 7, 9], [2, 4, 6, 8]])
    cache = StaticCache(config=model.config, max_cache_len=16)
    inputs = {"input_ids": ids, "past_key_values": cache, "use_cache": True}
    program = DynamoExporter().export(model, inputs, DynamoConfig())
    torch.export.save(program, str(tmp_path / "model.pt2"))

    fresh = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        expected = model(input_ids=ids, past_key_values=StaticCache(config=model.config, max_cache_len=16)).logits
    torch.save({"input_ids": ids, "past_key_values": fresh, "use_cache": True}, tmp_path / "kwargs.pt")
    run = subprocess.run(
        [sys.executable, "-c", _LOAD, str(tmp_path / "model.pt2"), str(tmp_path / "kwargs.pt"), str(tmp_path / "o.pt")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    torch.testing.assert_close(torch.load(tmp_path / "o.pt"), expected, atol=1e-5, rtol=1e-5)


def test_grouped_mm_moe_stays_grouped_mm_on_dynamo() -> None:
    # Seed 000: grouped_mm MoE traces through DynamoExporter as it is; only other backends swap the experts.
    tiny = get_tiny_model("tiny-qwen3-moe")
    model, inputs = tiny.build().eval(), tiny.sample_inputs()
    exporter = DynamoExporter()
    program = exporter.export(model, inputs, DynamoConfig(dynamic=True))
    ops = {str(node.target) for node in program.graph.nodes if node.op == "call_function"}
    assert any("grouped_mm" in op for op in ops), sorted(ops)
    assert not any("bmm" in op for op in ops), "a batched-experts rule ran on Dynamo"
    outcomes = {o.id: o.status for o in exporter.report.rules}
    assert outcomes["patch/moe-batched-experts"] == "other-backend"
    shorter = {k: v[:, :5] if isinstance(v, torch.Tensor) and v.ndim == 2 else v for k, v in inputs.items()}
    for sample in (inputs, shorter):
        with torch.no_grad():
            expected = model(**sample).logits
        torch.testing.assert_close(program.module()(**sample).logits, expected, atol=1e-5, rtol=1e-5)
