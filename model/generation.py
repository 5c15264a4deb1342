"""The core's `generate` (model/core/generate.py) grown to batches, every cache kind and compiled steps:
`stream` yields every row's next token, and `generate` returns the prompt(s) and new tokens. What is drawn
is a `Sampling` (model/sampling.py); how the tokens are computed, a `Decoding`: with the KV cache or
without, its dtype, the prefill's chunks and shared prefix, a compiled step. A context run into the cache
is model/prefill.py's; the compiled step, model/decode_step.py's; a checkpoint loaded to decode,
model/loading.py's.

    generate(model, idx, 100, temperature=0.8, top_k=200)    # prompt + 100 new tokens
    for token in stream(model, idx, Sampling(100), Decoding(kv_dtype="int8")): ...  # (B,) each step

With and without the cache the same tokens come out while prompt + new tokens fit in block_size
(past it the uncached reference crops the context at every step, the cache refills from the last
block_size // 2); each row of a batch is generated as its prompt would be alone. Bit for bit where
the products of both round alike; else in float32 to float32's rounding, in bfloat16 and int8 to
theirs (docs/generation.md, "What is exact, and where").
"""

import dataclasses
import math

import torch

from model.config import check_integer
from model.decode_step import CompiledDecodeStep, CudnnAttentionOff
from model.kernels import compiling_pays
from model.kv_cache import storage_dtype
from model.prefill import make_room, prefill
from model.sampling import Sampling, sample_next


@dataclasses.dataclass(frozen=True)
class Decoding:
    """How a stream computes the tokens its `Sampling` draws: with the KV cache, or each step from
    scratch (kv_cache=False: the reference the cached stream equals); the cache stored in kv_dtype
    (float32, bfloat16, int8, by dtype or name; None: the model's); the prompt fed prefill_chunk
    tokens a pass (None: at once); a prompt prefix the rows share computed once (share_prefix); a
    `CompiledDecodeStep` whose step and static cache replace the eager ones (decode_step; none
    without the cache); only the ids below vocab_size drawn (a tokenizer's; None: every id).
    Checked when made (each message names the option), kv_dtype made a torch dtype; what depends on
    the model and the prompt is checked once a stream (`check_generation`)."""

    kv_cache: bool = True
    kv_dtype: torch.dtype | str | None = None
    prefill_chunk: int | None = None
    share_prefix: bool = True
    decode_step: CompiledDecodeStep | None = None
    vocab_size: int | None = None

    def __post_init__(self):
        for name in ("kv_cache", "share_prefix"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.kv_dtype is not None:
            object.__setattr__(self, "kv_dtype", storage_dtype(self.kv_dtype, "kv_dtype"))
        if self.prefill_chunk is not None:
            check_integer(self.prefill_chunk, "prefill_chunk", 1)
        if self.vocab_size is not None:
            check_integer(self.vocab_size, "vocab_size", 1)
        if not self.kv_cache:
            object.__setattr__(self, "decode_step", None)  # no cache, no decode step
        step = self.decode_step
        if step is not None and not isinstance(step, CompiledDecodeStep):
            raise ValueError(f"decode_step must be a CompiledDecodeStep built for this model, got "
                             f"{type(step).__name__}")
        if step is not None and self.kv_dtype not in (None, step.cache.dtype):
            raise ValueError(f"kv_dtype={self.kv_dtype}, but the decode step's cache stores "
                             f"{step.cache.dtype}: build the CompiledDecodeStep with this kv_dtype")


def check_generation(model, idx, sampling: Sampling, decoding: Decoding, generator=None, pad=None) -> None:
    """What `stream`'s arguments are checked for against the model and the prompt, once per call:
    `sampling` is a Sampling and `decoding` a Decoding; the prompt's ids (B, T) are the model's, its
    positions allow max_new_tokens more, `pad` (B,) counts each row's left padding; the generators
    are one per row on the model's device; vocab_size is at most the model's; the decode step is
    this model's, with room for B rows."""
    c, device = model.config, model.wte.weight.device
    vocab = c.vocab_size
    if not isinstance(sampling, Sampling):
        raise TypeError(f"sampling must be a Sampling, e.g. Sampling(100, temperature=0.8); got {sampling!r}")
    if not isinstance(decoding, Decoding):
        raise TypeError(f"decoding must be a Decoding, e.g. Decoding(kv_dtype='int8'); got {decoding!r}")
    max_new_tokens = sampling.max_new_tokens
    if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.size(1) == 0 or idx.is_floating_point():
        raise ValueError("idx must be a (B, T) tensor of token ids with T >= 1, got " + (
            f"{idx.dtype} {tuple(idx.shape)}" if isinstance(idx, torch.Tensor) else type(idx).__name__))
    if idx.numel() and not 0 <= int(idx.min()) <= int(idx.max()) < vocab:
        raise ValueError(f"idx: token ids must be in 0..{vocab - 1} (the model's vocabulary), got "
                         f"{int(idx.min())}..{int(idx.max())}")
    B, T = idx.shape
    if max_new_tokens > (allowed := new_tokens_allowed(c, T)):
        raise ValueError(f"{T} prompt + {max_new_tokens} new tokens exceed block_size={c.block_size}: "
                         f"a sliding-window model (attn_window) with learned positions generates at most "
                         f"max_new_tokens={allowed} here (with pos_emb=rope, without end)")
    if pad is not None and (pad.shape != (B,) or not 0 <= int(pad.min()) <= int(pad.max()) < T):
        raise ValueError(f"pad must be ({B},): each row's count of padding, below T={T}")
    generators = generator if isinstance(generator, (list, tuple)) else [generator]
    if isinstance(generator, (list, tuple)) and len(generator) != B:
        raise ValueError(f"generator: a list needs one per row, {B}; got {len(generator)}")
    for g in generators:
        if g is not None and (not isinstance(g, torch.Generator) or g.device.type != device.type):
            raise ValueError(f"generator must be a torch.Generator on {device.type} (the model's device) "
                             f"or a list of them, got {g!r}")
    if decoding.vocab_size is not None:
        check_integer(decoding.vocab_size, "vocab_size", 1, vocab)
    for i in sampling.eos_ids:
        check_integer(i, "eos_ids", 0, (decoding.vocab_size or vocab) - 1)
    if (step := decoding.decode_step) is not None:
        if step.model is not model:
            raise ValueError("decode_step must be a CompiledDecodeStep built for this model")
        if B > (rows := step.cache.batch_size):
            raise ValueError(f"the compiled decode step serves batches of up to {rows} rows, got {B}")


def left_pad(prompts, device):
    """A (B, T) tensor as is, or a list of 1-D prompts left-padded with zeros into one.
    Returns (idx, pad) where pad (B,) counts the padding of each row, or None."""
    if isinstance(prompts, torch.Tensor):
        return prompts.to(device), None  # (checked by stream)
    rows = [torch.as_tensor(p).flatten() for p in prompts]
    if not rows or any(len(r) == 0 or r.is_floating_point() or r.is_complex() for r in rows):
        raise ValueError("idx: every prompt of a list needs one token id or more (integers)")
    rows = [r.long() for r in rows]
    T = max(len(r) for r in rows)
    idx = torch.zeros(len(rows), T, dtype=torch.long)                   # (B, T)
    for b, r in enumerate(rows):
        idx[b, T - len(r):] = r
    pad = torch.tensor([T - len(r) for r in rows], device=device)      # (B,)
    return idx.to(device), pad if pad.any() else None


@torch.no_grad()
def generate(model, idx, max_new_tokens, *, temperature=1.0, top_k=None, top_p=None, eos_ids=(),
             generator=None, **options):
    """Sample max_new_tokens after the prompt(s), as nanoGPT's `generate`; a row ends at the first of
    `eos_ids` it draws (`tokenizer.eos_ids`). `idx` is a (B, T) tensor, or a list of 1-D prompts of
    different lengths. Returns prompt + new tokens: a (B, T + n) tensor, n <= max_new_tokens (fewer
    where every row ended; a row that ended first repeats its eos id), or for a list, a list of 1-D
    tensors, each up to its eos id. temperature=0 is greedy. The sampling options make a `Sampling`;
    `options` (kv_cache, kv_dtype, prefill_chunk, share_prefix, decode_step, vocab_size) a
    `Decoding`; `generator` is `stream`'s."""
    sampling = Sampling(max_new_tokens, temperature, top_k, top_p, eos_ids)
    decoding = Decoding(**options)
    prompts, pad = left_pad(idx, model.wte.weight.device)
    new = list(stream(model, prompts, sampling, decoding, generator=generator, pad=pad))
    out = torch.cat([prompts, *(t[:, None] for t in new)], dim=1)  # (B, T + n)
    if isinstance(idx, torch.Tensor):
        return out
    pads = [0] * len(out) if pad is None else pad.tolist()  # None: the prompts had one length
    ended = torch.isin(out[:, prompts.size(1):], torch.tensor(sampling.eos_ids, device=out.device))  # (B, n)
    ends = torch.where(ended.any(1), ended.int().argmax(1) + 1, ended.size(1)) + prompts.size(1)   # (B,)
    return [row[p:end] for row, p, end in zip(out, pads, ends.tolist())]


def stream(model, idx, sampling: Sampling, decoding: Decoding | None = None, *, generator=None, pad=None):
    """Yield the next token of every row of idx (B, T), (B,), as `sampling` draws them:
    max_new_tokens times, computed as `decoding` says (None: Decoding(), the eager cached stream).

    The prompt goes into the KV cache once (`prefill`); then each token drawn is fed back, one step
    at a time, and a full cache is refilled with the recent tokens (`make_room`). Without the cache
    each step runs the context from scratch. `generator` is one torch.Generator, or a list of one
    per row; `pad` (B,) counts each row's left padding (`left_pad`), or None. Checked here, once, by
    the call itself: a generator's body runs at the first token asked for, so a caller that printed
    the prompt first (a streamed sample) printed it, then failed."""
    decoding = Decoding() if decoding is None else decoding
    check_generation(model, idx, sampling, decoding, generator, pad)
    return drawn(model, idx, sampling, decoding, generator, pad)


@torch.no_grad()
def drawn(model, idx, sampling: Sampling, decoding: Decoding, generator, starts):
    """`stream`'s tokens, its arguments checked: the prompt run into a new cache (or the decode
    step's), then `decoded`."""
    (B, T), max_new_tokens = idx.shape, sampling.max_new_tokens
    context = TokenBuffer(idx, starts, model.config.context_size or T + max_new_tokens, max_new_tokens)
    cache = None if decoding.decode_step is None else decoding.decode_step.cache  # its first B rows serve
    if decoding.kv_cache and cache is None:
        cells = min(model.config.block_size, T + max_new_tokens)
        cache = model.new_kv_cache(B, cells, dtype=decoding.kv_dtype)
    # Inference mode (~15% faster a step on a CPU), no cuDNN attention; the tokens, sampled outside it,
    # are plain tensors to train on. cache_starts (B,): the column of each row's position 0 in the cache.
    with torch.inference_mode(), CudnnAttentionOff():
        logits, cache_starts = prefill(model, context.tokens, cache, starts, decoding.prefill_chunk,
                                       decoding.share_prefix)
    yield from decoded(model, context, cache, cache_starts, logits, sampling, decoding, generator)


def decoded(model, context, cache, cache_starts, logits, sampling: Sampling, decoding: Decoding, generator):
    """The tokens drawn after `logits` (B, vocab), the prompt's in `context` (a TokenBuffer) and in
    `cache` (None: each step runs the context from scratch) from columns cache_starts: each fed back
    one step at a time, a full cache refilled with the recent tokens (`make_room`). A row that drew
    one of sampling.eos_ids repeats it; the stream ends when every row has."""
    B, max_new_tokens, vocab_size = context.tokens.size(0), sampling.max_new_tokens, decoding.vocab_size
    decode_step, chunk = decoding.decode_step, decoding.prefill_chunk
    if cache is not None and cache.quantized:  # its steps' kernel, one for the sample (one_query_kernel)
        may_compile = compiling_pays(cache, context.filled, max_new_tokens - 1, model.config.n_layer)
        for _, _, stored in cache.stores():
            stored.may_compile = may_compile
    step = decode_step or eager_step(model)
    # On CUDA the decode step draws the next token itself, inside its CUDA graph (None where it cannot).
    step_draws = decode_step.sampler(sampling, vocab_size, generator, B) if decode_step is not None else None
    eos = torch.tensor(sampling.eos_ids, device=logits.device) if sampling.eos_ids else None
    ended = torch.zeros(B, dtype=torch.bool, device=logits.device)       # (B,) rows that drew an eos id
    no_cudnn = CudnnAttentionOff()
    token = sample_next(logits[:, :vocab_size], sampling, generator) if max_new_tokens else None  # (B,)
    for i in range(max_new_tokens):
        if eos is not None:
            token = torch.where(ended, context.tokens[:, -1], token) if i else token  # ended: its eos again
            ended |= torch.isin(token, eos)
        yield token
        if i == max_new_tokens - 1 or eos is not None and bool(ended.all()):
            break
        context.append(token)
        with torch.inference_mode(), no_cudnn:
            if cache is None:
                logits, _ = prefill(model, context.tokens, None, context.starts)
            else:
                if cache.full:
                    cache_starts = make_room(model, context.tokens[:, :-1], cache, cache_starts, chunk)
                logits = (step_draws or step)(token[:, None], cache, cache_starts)  # (B, vocab); drawn: (B,)
        token = logits.clone() if step_draws else sample_next(logits[:, :vocab_size], sampling, generator)


def eager_step(model):
    """The one-token step as the model's own forward pass: (token (B, 1), cache, starts) -> (B, vocab)."""
    return lambda token, cache, starts: model(token, kv_cache=cache, starts=starts)[:, -1]


class TokenBuffer:
    """The prompt and the tokens so far, (B, filled), in one tensor written in place (`tokens`):
    what the uncached reference and a refill run again. When it is full, only the last `history`
    stay (all any step reads again), moved to the front; `starts` moves with them, below 0 once a
    row's padding is cut off."""

    def __init__(self, idx, starts, history: int, max_new_tokens: int):
        B, T = idx.shape
        self.history, self.starts, self.filled = history, starts, T
        self.buffer = torch.empty(B, min(T + max_new_tokens, max(T, 2 * history)), dtype=idx.dtype,
                                  device=idx.device)                     # (B, capacity)
        self.buffer[:, :T] = idx

    @property
    def tokens(self) -> torch.Tensor:
        return self.buffer[:, :self.filled]                              # (B, filled)

    def append(self, token) -> None:
        """token (B,) after the last."""
        if self.filled == self.buffer.size(1):
            cut = self.filled - self.history
            self.buffer[:, :self.history] = self.buffer[:, cut:self.filled].clone()
            self.starts = None if self.starts is None else self.starts - cut     # (B,)
            self.filled = self.history
        self.buffer[:, self.filled] = token
        self.filled += 1


def new_tokens_allowed(config, prompt_len: int) -> float:
    """How many tokens may follow a prompt of prompt_len: as many as wanted (inf), except with a
    sliding window and learned positions, which end at block_size (no refill keeps a window)."""
    if config.attn_window is not None and config.pos_emb == "learned":
        return max(0, config.block_size - prompt_len)
    return math.inf
