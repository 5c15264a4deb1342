"""Decode speed measured, as generate.py's benchmark and benchmarks/ time it. A stream's seconds to
its first token and for the rest (`timed_stream`); eager one-token steps' tokens/s at the end of a
long cache (`decode_tokens_per_s`)."""

import torch

from model.config import check_integer
from model.device import synchronized_clock
from model.generation import Decoding, stream
from model.sampling import Sampling


def timed_stream(model, idx, max_new_tokens: int, decoding: Decoding | None = None,
                 pad=None) -> tuple[float, float]:
    """(seconds to the first token, seconds for the rest) of one greedy generation of every row
    of idx (B, T), computed as `decoding` says, left-padded by `pad` (B,) or not."""
    clock = synchronized_clock(idx.device)
    t0 = clock()
    tokens = stream(model, idx, Sampling(max_new_tokens, temperature=0), decoding, pad=pad)
    next(tokens)
    t1 = clock()
    for _ in tokens:
        pass
    return t1 - t0, clock() - t1


@torch.no_grad()
def decode_tokens_per_s(model, batch_size: int, context: int, kv_dtype=None, steps: int = 8,
                        cache_options: dict | None = None) -> float:
    """Tokens/s of eager one-token steps at the end of a `context`-long cache stored in kv_dtype
    ("int4" too), after as many warm-up steps; `cache_options` go to new_kv_cache (int4_recent,
    int4_group). The cache is filled with random numbers instead of a prefill, which would cost far
    more than the measurement (speed does not depend on them)."""
    check_integer(steps, "steps", 1)
    check_integer(context, "context", 2 * steps, model.config.block_size)
    cache = model.new_kv_cache(batch_size, context, dtype=kv_dtype, **(cache_options or {}))
    for t in cache.buffers:  # (an int4 cache's bytes: two numbers each)
        if t.is_floating_point():
            t.normal_()
        else:
            t.random_(0, 256) if t.dtype == torch.uint8 else t.random_(-127, 128)
    cache.advance(context - 2 * steps)
    token = torch.zeros(batch_size, 1, dtype=torch.long, device=model.wte.weight.device)
    for _ in range(steps):  # warm-up
        model(token, kv_cache=cache)
    clock = synchronized_clock(token.device)
    t0 = clock()
    for _ in range(steps):
        model(token, kv_cache=cache)
    return batch_size * steps / (clock() - t0)
