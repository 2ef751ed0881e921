"""Train the code model fixture: a small Llama on the Python standard library's source, on one CPU thread.

    nice -n 10 python tools/train_code_lm.py [--out tests/fixtures/code_lm] [--steps 1200] [--quick]

What it does, deterministically (sorted file lists, fixed seeds, one thread):
1. The corpus: every `.py` file under the running interpreter's `sysconfig.get_paths()["stdlib"]`, sorted by
   path, except `site-packages` and the test suites (folders named `test`, `tests`, `idle_test`); files that are
   not UTF-8 are skipped. A file is held out when the first byte of the SHA-256 of its relative path is below
   13 (about 5 %); the rest is the training text. The stdlib differs between Python versions, so the metadata
   records the version, the file counts and SHA-256 hashes of both texts.
2. A byte-level BPE tokenizer (the `tokenizers` library, 4096 entries, `<|endoftext|>` between files) trained
   on the training text only.
3. A Llama (4 layers, hidden 256, 8 heads, 2 key/value heads, MLP 768, tied embeddings: 4.1 M parameters)
   trained with AdamW under bf16 autocast (fp32 weights) on random 256-token windows of the training stream
   (seed 0), 16 per step, 1200 steps, cosine learning rate.
4. The held-out perplexity over the whole held-out stream (256-token windows), and greedy continuations of a
   few Python prompts, printed.
5. The fixture: a Hugging Face folder (config.json, generation_config.json, model.safetensors in fp32, the
   tokenizer files), `training.json` (the metadata, the time, the perplexity) and `heldout.txt` (whole
   held-out files, sorted by path, about 64 KB: the text the tests and `--validate` measure on).

`--quick`: 20 steps into a temporary folder unless `--out` is given (a smoke run; the model is useless).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAYON_NUM_THREADS", "1")  # the tokenizers trainer: one thread, like the training

import torch

from hfexport.artifacts.eval_text import SKIPPED_FOLDERS, StdlibCorpus, heldout_sample, read_stdlib

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "code_lm"
EOS = "<|endoftext|>"
PROMPTS = ("def ", "import ", "class ", "    def __init__(self", "for i in range(")


def corpus_text(corpus: StdlibCorpus, names: list[str]) -> str:
    """The texts of `names`, each followed by the end-of-text token (the training stream's layout)."""
    return "".join(corpus.texts[name] + EOS for name in names)


def train_tokenizer(corpus: StdlibCorpus, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((corpus.texts[name] for name in corpus.train), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=EOS, eos_token=EOS, pad_token=EOS, unk_token=None
    )


def token_stream(tokenizer, corpus: StdlibCorpus, names: list[str]) -> torch.Tensor:
    eos = tokenizer.convert_tokens_to_ids(EOS)
    ids: list[int] = []
    for name in names:
        ids.extend(tokenizer(corpus.texts[name], add_special_tokens=False)["input_ids"])
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def build_model(vocab_size: int, eos: int, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=eos,
        eos_token_id=eos,
        pad_token_id=eos,
    )
    return LlamaForCausalLM(config)


@torch.no_grad()
def perplexity(model, stream: torch.Tensor, window: int) -> float:
    """exp(mean next-token NLL) over consecutive `window`-token pieces of `stream` (the last piece shorter)."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(stream) - 1, window):
        piece = stream[start : start + window + 1]
        if len(piece) < 2:
            break
        logits = model(piece[None, :-1]).logits[0]
        total += torch.nn.functional.cross_entropy(logits, piece[1:], reduction="sum").item()
        count += len(piece) - 1
    return math.exp(total / count)


def train(model, stream: torch.Tensor, steps: int, batch: int, window: int, lr: float, seed: int, bf16: bool) -> None:
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    warmup = max(1, steps // 30)

    def schedule(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
    model.train()
    started = time.perf_counter()
    for step in range(steps):
        starts = torch.randint(0, len(stream) - window - 1, (batch,), generator=generator)
        pieces = torch.stack([stream[s : s + window + 1] for s in starts.tolist()])
        # bf16 autocast (fp32 master weights): the step costs 0.65x of fp32 on a CPU with AMX/AVX-512 bf16.
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(pieces[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), pieces[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        scheduler.step()
        if step % 100 == 0 or step == steps - 1:
            elapsed = time.perf_counter() - started
            print(f"step {step}/{steps} loss {loss.item():.3f} {elapsed:.0f}s", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help=f"the fixture folder (default {FIXTURE.relative_to(ROOT)})")
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--fp32", action="store_true", help="train in fp32 (default: bf16 autocast)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="20 steps into a temporary folder (a smoke run)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps = 20
    out = args.out or (Path(tempfile.mkdtemp(prefix="code_lm-")) if args.quick else FIXTURE)

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    corpus = read_stdlib()
    train_text, heldout_text = corpus_text(corpus, corpus.train), corpus_text(corpus, corpus.heldout)
    tokenizer = train_tokenizer(corpus, args.vocab)
    eos = tokenizer.convert_tokens_to_ids(EOS)
    train_ids = token_stream(tokenizer, corpus, corpus.train)
    heldout_ids = token_stream(tokenizer, corpus, corpus.heldout)
    prepared = time.perf_counter() - started
    print(
        f"{len(corpus.train)} training files ({len(train_text) / 1e6:.1f} MB, {len(train_ids)} tokens), "
        f"{len(corpus.heldout)} held out ({len(heldout_ids)} tokens); tokenizer and streams in {prepared:.0f}s",
        flush=True,
    )

    torch.manual_seed(args.seed)
    model = build_model(len(tokenizer), eos, args.layers)
    parameters = sum(p.numel() for p in model.parameters())
    print(f"{parameters / 1e6:.2f} M parameters", flush=True)
    train_started = time.perf_counter()
    train(model, train_ids, args.steps, args.batch, args.window, args.lr, args.seed, bf16=not args.fp32)
    train_seconds = time.perf_counter() - train_started
    model.eval()
    heldout_ppl = perplexity(model, heldout_ids, args.window)
    sample = heldout_sample(corpus)
    sample_ids = tokenizer(sample, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    sample_ppl = perplexity(model, sample_ids, args.window)
    print(
        f"trained {args.steps} steps in {train_seconds / 60:.1f} min; held-out perplexity {heldout_ppl:.2f} "
        f"(uniform: {len(tokenizer)}), on heldout.txt {sample_ppl:.2f}",
        flush=True,
    )

    model.generation_config.do_sample = False
    model.generation_config.max_new_tokens = 64
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "heldout.txt").write_text(sample)
    metadata = {
        "python": platform.python_version(),
        "stdlib": "sysconfig.get_paths()['stdlib'], *.py minus " + ", ".join(sorted(SKIPPED_FOLDERS)),
        "files": {
            "train": len(corpus.train),
            "heldout": len(corpus.heldout),
            "skipped_not_utf8": corpus.skipped_not_utf8,
        },
        "sha256": {
            "train_text": hashlib.sha256(train_text.encode()).hexdigest(),
            "heldout_text": hashlib.sha256(heldout_text.encode()).hexdigest(),
            "heldout_txt": hashlib.sha256(sample.encode()).hexdigest(),
        },
        "tokens": {"train": len(train_ids), "heldout": len(heldout_ids), "heldout_txt": len(sample_ids)},
        "versions": {
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "tokenizers": __import__("tokenizers").__version__,
        },
        "training": {
            key: getattr(args, key) for key in ("steps", "batch", "window", "layers", "vocab", "lr", "seed", "fp32")
        },
        "parameters": parameters,
        "train_minutes": round(train_seconds / 60, 1),
        "heldout_perplexity": round(heldout_ppl, 3),
        "heldout_txt_perplexity": round(sample_ppl, 3),
        "cpu": platform.processor() or platform.machine(),
    }
    (out / "training.json").write_text(json.dumps(metadata, indent=2) + "\n")

    for prompt in PROMPTS:
        inputs = tokenizer(prompt, return_tensors="pt")
        output = model.generate(**inputs, max_new_tokens=48, do_sample=False)
        print(f"--- {prompt!r}\n{tokenizer.decode(output[0])}", flush=True)
    print(f"wrote {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
