"""Choosing the next token: the logits processors a generation spec records, then greedy or sampled choice."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hfexport.generation_spec import GenerationSpec


def process_logits(
    scores: torch.Tensor, spec: GenerationSpec, index: int, max_new_tokens: int, width: int
) -> torch.Tensor:
    """The logits processors of the model's generation config that the spec records, in transformers' order:
    suppressed ids, ids suppressed at the first new token, then a forced first token and a forced last one.
    `width` is the length of the ids generation started from (transformers forces a first token only when
    that is the single decoder start token)."""
    vocab = scores.shape[-1]
    forces_first = spec.forced_bos_token_id is not None and width == 1

    def only(ids: list[int]) -> torch.Tensor:
        return torch.tensor([i for i in ids if 0 <= i < vocab], dtype=torch.long)

    if spec.suppress_tokens:
        scores = scores.float().index_fill(-1, only(spec.suppress_tokens), float("-inf"))
    if index == (1 if forces_first else 0) and spec.begin_suppress_tokens:
        scores = scores.float().index_fill(-1, only(spec.begin_suppress_tokens), float("-inf"))
    forced: list[int] = []
    if index == 0 and forces_first:
        forced = [spec.forced_bos_token_id]
    elif index == max_new_tokens - 1 and spec.forced_eos_token_id:
        forced = spec.forced_eos_token_id
    if forced:
        kept = torch.full_like(scores.float(), float("-inf"))
        scores = kept.index_fill(-1, only(forced), 0.0)
    return scores


@dataclass
class Sampler:
    """Greedy (`do_sample=False`) or sampled choice of one token per row, after temperature, top-k and top-p."""

    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float | None
    generator: torch.Generator | None = field(default=None)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        logits = logits.float()
        if not self.do_sample:
            return logits.argmax(-1)
        if self.temperature and self.temperature != 1.0:
            logits = logits / self.temperature
        if self.top_k:
            kth = torch.topk(logits, min(self.top_k, logits.shape[-1])).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if self.top_p is not None and self.top_p < 1.0:
            ordered, index = logits.sort(-1, descending=True)
            cumulative = ordered.softmax(-1).cumsum(-1)
            drop = cumulative - ordered.softmax(-1) > self.top_p  # keep the smallest set reaching top_p
            logits = logits.scatter(-1, index, ordered.masked_fill(drop, float("-inf")))
        return torch.multinomial(logits.softmax(-1), 1, generator=self.generator).squeeze(-1)


def keep_eos_away(scores: torch.Tensor, eos_ids: torch.Tensor) -> torch.Tensor:
    """As transformers' MinNewTokensLengthLogitsProcessor: no end of sequence before min_new_tokens (ids beyond
    the vocabulary, which some configs carry, cannot be produced anyway)."""
    in_vocab = eos_ids[eos_ids < scores.shape[-1]]
    return scores.float().index_fill(-1, in_vocab, float("-inf"))
