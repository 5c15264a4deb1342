"""The core's sampling (model/core/generate.py), checked once and drawable in a CUDA graph. A `Sampling`
(how many tokens, temperature, top-k, top-p) is checked once when made; `sample_next` draws one token per
row with it, greedy or seeded, in the same numbers on a CPU and inside a CUDA graph."""

import dataclasses
import math

import torch
import torch.nn.functional as F

from model.config import check_integer, is_real
from model.core.generate import keep_top

FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclasses.dataclass(frozen=True)
class Sampling:
    """What a stream draws: max_new_tokens tokens per row, greedy at temperature 0, else sampled
    among the tokens top_k and top_p keep (the core's keep_top); a row ends at the first of eos_ids
    it draws (a tokenizer's end-of-text ids: `tokenizer.eos_ids`), which it repeats while other rows
    go on. Checked once, when made (eos_ids made a tuple)."""

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None
    eos_ids: tuple[int, ...] = ()

    def __post_init__(self):
        check_integer(self.max_new_tokens, "max_new_tokens", 0)
        if not is_real(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a number >= 0 and finite, got {self.temperature!r}")
        if self.top_k is not None:
            check_integer(self.top_k, "top_k", 1)
        if self.top_p is not None and (not is_real(self.top_p) or not 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        ids = [self.eos_ids] if isinstance(self.eos_ids, int) else self.eos_ids
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"eos_ids must be token ids (a list, or one id), got {self.eos_ids!r}")
        for i in ids:
            check_integer(i, "eos_ids", 0)
        object.__setattr__(self, "eos_ids", tuple(int(i) for i in ids))


def sample_next(logits, sampling: Sampling, generator=None):
    """One token per row from logits (B, vocab), drawn as `sampling` says. `generator` is one
    torch.Generator for the batch, or a list of one per row: then each row draws exactly what it
    would draw alone with its generator."""
    temperature, top_k, top_p = sampling.temperature, sampling.top_k, sampling.top_p
    if temperature == 0:
        return logits.argmax(dim=-1)
    # Shifted so that the largest is 0 and scaled by 1 / temperature, at most float32's largest
    # number: however small the temperature, no logit overflows into inf - inf (NaN).
    logits = logits.float()
    scale = FLOAT32_MAX if temperature * FLOAT32_MAX < 1 else 1 / temperature
    logits = (logits - logits.amax(dim=-1, keepdim=True)) * scale
    probs = F.softmax(keep_top(logits, top_k, top_p), dim=-1)
    if isinstance(generator, (list, tuple)):
        return torch.cat([draw(p[None], g) for p, g in zip(probs, generator)])  # (B,)
    return draw(probs, generator)


def draw(probs, generator=None):
    """One index per row of probs (B, vocab), index i with probability probs[:, i]: torch.multinomial's
    own method for one sample (the argmax of p / q, q ~ Exp(1)), so its numbers bit for bit, written
    out because multinomial first checks the probabilities on the host, which a CUDA graph cannot
    hold (the decode step samples inside its graph)."""
    return (probs / torch.empty_like(probs).exponential_(generator=generator)).argmax(dim=-1)  # (B,)
