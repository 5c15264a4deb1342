"""How the next token is drawn from a model's logits. A `Sampling` (how many tokens, temperature,
top-k, top-p) is checked once when made; `sample_next` draws one token per row with it, greedy or
seeded, in the same numbers on a CPU and inside a CUDA graph."""

import dataclasses
import math

import torch
import torch.nn.functional as F

from model.config import check_integer, is_real

FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclasses.dataclass(frozen=True)
class Sampling:
    """What a stream draws: max_new_tokens tokens per row, each greedy at temperature 0, else by
    softmax sampling restricted to the top_k tokens and to the smallest set whose probability
    reaches top_p. Checked when made (each message names the option), so never again per call."""

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        check_integer(self.max_new_tokens, "max_new_tokens", 0)
        if not is_real(self.temperature) or not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a number >= 0 and finite, got {self.temperature!r}")
        if self.top_k is not None:
            check_integer(self.top_k, "top_k", 1)
        if self.top_p is not None and (not is_real(self.top_p) or not 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")


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
    if top_k is not None and top_k < logits.size(-1):  # top_k >= vocab keeps every token
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]             # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, vocab) each
        probs = F.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already reach top_p.
        drop_sorted = probs.cumsum(dim=-1) - probs >= top_p
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    probs = F.softmax(logits, dim=-1)
    if isinstance(generator, (list, tuple)):
        return torch.cat([draw(p[None], g) for p, g in zip(probs, generator)])  # (B,)
    return draw(probs, generator)


def draw(probs, generator=None):
    """One index per row of probs (B, vocab), index i with probability probs[:, i]: torch.multinomial's
    own method for one sample (the argmax of p / q, q ~ Exp(1)), so its numbers bit for bit, written
    out because multinomial first checks the probabilities on the host, which a CUDA graph cannot
    hold (the decode step samples inside its graph)."""
    return (probs / torch.empty_like(probs).exponential_(generator=generator)).argmax(dim=-1)  # (B,)
