"""Producing tokens from a GPT: the stream of new tokens, and `generate` around it. The stream
runs with the KV cache or without, for one row or a batch of left-padded prompts; here too are a
checkpoint loaded to decode and the stream timed. How a token is drawn is model/sampling.py's;
a context run into the cache, model/prefill.py's; the compiled step, model/decode_step.py's.

    model, ckpt = load_model("outputs/<run>")                # its best.pt, ready to decode
    generate(model, idx, 100, temperature=0.8, top_k=200)    # prompt + 100 new tokens
    for token in stream(model, idx, Sampling(100)): ...      # (B,) new tokens, one step at a time

With and without the cache the same tokens come out while prompt + new tokens fit in block_size
(past it the uncached reference crops the context at every step, the cache refills from the last
block_size // 2); each row of a batch is generated as its prompt would be alone. Bit for bit where
the products of both round alike; else in float32 to float32's rounding, in bfloat16 and int8 to
theirs (docs/generation.md, "What is exact, and where").
"""

import dataclasses
import itertools
import math
from pathlib import Path

import torch

from model.attention import compiling_pays
from model.checkpoint import is_pretrained, load, load_weights, pretrained_checkpoint
from model.config import check_integer
from model.decode_step import CompiledDecodeStep, CudnnAttentionOff
from model.device import AUTO_PRECISION, DTYPES, Precision, pick_device, synchronized_clock
from model.gpt import GPT
from model.kv_cache import storage_dtype
from model.prefill import make_room, prefill
from model.pretrained import folder_config
from model.quantize import quantize_int8
from model.sampling import Sampling, sample_next


def load_model(path, device="auto", precision: Precision = AUTO_PRECISION):
    """A checkpoint's GPT ready to decode, and the checkpoint: `path` is a checkpoint file, a run
    dir (its best.pt, else ckpt.pt) or a Hugging Face model folder (GPT.from_pretrained: the
    checkpoint holds the decoding model's weights); the model is on `device`, in eval mode, in the
    precision `for_decoding` gives it."""
    if is_pretrained(path):  # read in the dtype it decodes in: a billion parameters are not held twice
        device = pick_device(device) if isinstance(device, str) else device
        with torch.device("meta"):
            n_params = GPT(folder_config(path)[1]).num_params()
        dtype = DTYPES[precision.on(device, n_params)[0]]
        model = for_decoding(GPT.from_pretrained(Path(path).expanduser(), dtype=dtype), device, precision)
        return model, pretrained_checkpoint(model, path)
    ckpt = load(path, prefer="best.pt")
    model = GPT(dataclasses.replace(ckpt.model_config, dropout=0.0))  # decoding drops nothing out
    load_weights(model, ckpt.model)
    return for_decoding(model, device, precision), ckpt


def for_decoding(model, device="auto", precision: Precision = AUTO_PRECISION):
    """The model in eval mode, without gradients, on `device`, in the precision `precision` means
    there (int8 weights when it says so). (A weight that requires a gradient costs every matrix
    product a CPU decode makes ~2 µs more, inference mode or not.) On CUDA its output layer's rows
    are padded to a multiple of 64 (GPT.pad_head_rows: cuBLAS's aligned kernels)."""
    device = pick_device(device) if isinstance(device, str) else device
    dtype, quantize = precision.on(device, model.num_params())
    if quantize == "int8":
        quantize_int8(model)
    model = model.to(device=device, dtype=DTYPES[dtype]).eval().requires_grad_(False)
    return model.pad_head_rows() if device.type == "cuda" else model


def check_generation(model, idx, sampling, *, generator, vocab_size, decode_step, kv_dtype, pad=None,
                     prefill_chunk=None):
    """The arguments of `stream`, checked once per call: `sampling` is a Sampling, the prompt's ids
    (B, T) are the model's, its positions allow max_new_tokens more, the generators are one per row
    on the model's device, vocab_size is at most the model's, and the decode step is this model's,
    with room for B rows, in the cache dtype asked for. Returns kv_dtype as a torch dtype (or None)."""
    c, device = model.config, model.wte.weight.device
    vocab = c.vocab_size
    if not isinstance(sampling, Sampling):
        raise TypeError(f"sampling must be a Sampling, e.g. Sampling(100, temperature=0.8); got {sampling!r}")
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
    if isinstance(generator, (list, tuple)) and len(generator) != idx.size(0):
        raise ValueError(f"generator: a list needs one per row, {idx.size(0)}; got {len(generator)}")
    for g in generators:
        if g is not None and (not isinstance(g, torch.Generator) or g.device.type != device.type):
            raise ValueError(f"generator must be a torch.Generator on {device.type} (the model's device) "
                             f"or a list of them, got {g!r}")
    if vocab_size is not None:
        check_integer(vocab_size, "vocab_size", 1, vocab)
    if prefill_chunk is not None:
        check_integer(prefill_chunk, "prefill_chunk", 1)
    kv_dtype = None if kv_dtype is None else storage_dtype(kv_dtype, "kv_dtype")
    if decode_step is not None:
        if not isinstance(decode_step, CompiledDecodeStep) or decode_step.model is not model:
            raise ValueError("decode_step must be a CompiledDecodeStep built for this model")
        if B > (rows := decode_step.cache.batch_size):
            raise ValueError(f"the compiled decode step serves batches of up to {rows} rows, got {B}")
        if kv_dtype not in (None, decode_step.cache.dtype):
            raise ValueError(f"kv_dtype={kv_dtype}, but the decode step's cache stores "
                             f"{decode_step.cache.dtype}: build the CompiledDecodeStep with this kv_dtype")
    return kv_dtype


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
def generate(model, idx, max_new_tokens, *, temperature=1.0, top_k=None, top_p=None, kv_cache=True,
             generator=None, vocab_size=None, decode_step=None, kv_dtype=None, prefill_chunk=None,
             share_prefix=True):
    """Sample max_new_tokens after the prompt(s), as nanoGPT's `generate`. `idx` is a (B, T)
    tensor, or a list of 1-D prompts of different lengths. Returns prompt + new tokens: a
    (B, T + max_new_tokens) tensor, or for a list, a list of 1-D tensors. temperature=0 is
    greedy. The sampling options make a `Sampling`; the others are `stream`'s."""
    sampling = Sampling(max_new_tokens, temperature, top_k, top_p)
    prompts, pad = left_pad(idx, model.wte.weight.device)
    new = list(stream(model, prompts, sampling, kv_cache=kv_cache, generator=generator, pad=pad,
                      vocab_size=vocab_size, decode_step=decode_step, kv_dtype=kv_dtype,
                      prefill_chunk=prefill_chunk, share_prefix=share_prefix))
    out = torch.cat([prompts, *(t[:, None] for t in new)], dim=1)  # (B, T + max_new_tokens)
    if isinstance(idx, torch.Tensor):
        return out
    pads = [0] * len(out) if pad is None else pad.tolist()  # None: the prompts had one length
    return [row[p:] for row, p in zip(out, pads)]


def stream(model, idx, sampling: Sampling, *, kv_cache=True, generator=None, pad=None, decode_step=None,
           vocab_size=None, kv_dtype=None, prefill_chunk=None, share_prefix=True):
    """Yield the next token of every row, (B,), as `sampling` draws them: max_new_tokens times.

    The prompt goes into the KV cache once (`prefill`); then each token drawn is fed back, one step
    at a time, and a full cache is refilled with the recent tokens (`make_room`). Without the cache
    (kv_cache=False) each step runs the context from scratch: the reference the cached stream equals.
    Options: `kv_dtype`, what the cache stores (float32, bfloat16, int8; default the model's);
    `prefill_chunk`, prompt tokens per pass (None: at once); `share_prefix`, a prompt prefix the rows
    share computed once; `decode_step`, a `CompiledDecodeStep` whose step and static cache replace
    the eager ones; `vocab_size`, draw only the ids below it (a tokenizer's). Checked here, once, by
    the call itself: a generator's body runs at the first token asked for, so a caller that printed
    the prompt first (a streamed sample) printed it, then failed."""
    decode_step = decode_step if kv_cache else None  # no cache, no decode step
    kv_dtype = check_generation(model, idx, sampling, generator=generator, vocab_size=vocab_size,
                                decode_step=decode_step, kv_dtype=kv_dtype, pad=pad,
                                prefill_chunk=prefill_chunk)
    return drawn(model, idx, sampling, kv_cache, generator, pad, decode_step, vocab_size, kv_dtype,
                 prefill_chunk, share_prefix)


@torch.no_grad()
def drawn(model, idx, sampling, kv_cache, generator, pad, decode_step, vocab_size, kv_dtype, prefill_chunk,
          share_prefix):
    """`stream`'s tokens, its arguments checked."""
    (B, T), max_new_tokens = idx.shape, sampling.max_new_tokens
    context = TokenBuffer(idx, pad, model.config.context_size or T + max_new_tokens, max_new_tokens)
    cache = None if decode_step is None else decode_step.cache  # static: its first B rows serve this call
    if kv_cache and cache is None:
        cache = model.new_kv_cache(B, min(model.config.block_size, T + max_new_tokens), dtype=kv_dtype)
    if cache is not None and cache.quantized:  # its steps' kernel, one for the sample (one_query_kernel)
        may_compile = compiling_pays(cache, T, max_new_tokens - 1, model.config.n_layer)
        for _, _, stored in cache.stores():
            stored.may_compile = may_compile
    step = decode_step or eager_step(model)
    # On CUDA the decode step draws the next token itself, inside its CUDA graph (None where it cannot).
    step_draws = decode_step.sampler(sampling, vocab_size, generator, B) if decode_step is not None else None

    # cache_pad (B,): the pad cells among the cache's. Inference mode (~15% faster a step on a CPU),
    # no cuDNN attention; the tokens, sampled outside it, are plain tensors one may train on.
    no_cudnn = CudnnAttentionOff()
    with torch.inference_mode(), no_cudnn:
        logits, cache_pad = prefill(model, context.tokens, cache, pad, prefill_chunk, share_prefix)
    token = sample_next(logits[:, :vocab_size], sampling, generator) if max_new_tokens else None  # (B,)
    for i in range(max_new_tokens):
        yield token
        if i == max_new_tokens - 1:
            break
        context.append(token)
        with torch.inference_mode(), no_cudnn:
            if cache is None:
                logits, _ = prefill(model, context.tokens, None, context.pad)
            else:
                if cache.full:
                    cache_pad = make_room(model, context.tokens[:, :-1], cache, cache_pad, prefill_chunk)
                logits = (step_draws or step)(token[:, None], cache, cache_pad)  # (B, vocab), or drawn: (B,)
        token = logits.clone() if step_draws else sample_next(logits[:, :vocab_size], sampling, generator)


def eager_step(model):
    """The one-token step as the model's own forward pass: (token (B, 1), cache, pad) -> (B, vocab)."""
    return lambda token, cache, pad: model(token, kv_cache=cache, pad=pad)[:, -1]


class TokenBuffer:
    """The prompt and the tokens so far, (B, filled), in one tensor written in place (`tokens`):
    what the uncached reference and a refill run again. When it is full, only the last `history`
    stay (all any step reads again), moved to the front; `pad` moves with them, below 0 once a
    row's padding is cut off."""

    def __init__(self, idx, pad, history: int, max_new_tokens: int):
        B, T = idx.shape
        self.history, self.pad, self.filled = history, pad, T
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
            self.pad = None if self.pad is None else self.pad - cut     # (B,)
            self.filled = self.history
        self.buffer[:, self.filled] = token
        self.filled += 1


def new_tokens_allowed(config, prompt_len: int) -> float:
    """How many tokens may follow a prompt of prompt_len: as many as wanted (inf), except with a
    sliding window and learned positions, which end at block_size (no refill keeps a window)."""
    if config.attn_window is not None and config.pos_emb == "learned":
        return max(0, config.block_size - prompt_len)
    return math.inf


def sample_ids(model, prompt: list[int], max_new_tokens: int, seed: int, vocab_size=None,
               stop=()) -> list[int]:
    """A sample as nanoGPT's sample.py draws it (temperature 0.8, top_k 200, seeded): `prompt` and
    max_new_tokens after it, fewer where the model's positions end sooner (new_tokens_allowed), or
    where `stop` (a list a signal handler appends to) gets a signal: the tokens drawn until then. On
    CUDA each token is one replay of the step captured as a CUDA graph, as `generate.py` samples
    there, not a pass of the model launched kernel by kernel from Python."""
    device = model.wte.weight.device
    n = min(max_new_tokens, new_tokens_allowed(model.config, len(prompt)))
    step = CompiledDecodeStep(model.eval(), backend="cuda_graph") if device.type == "cuda" and n > 1 else None
    sampling, generator = Sampling(n, temperature=0.8, top_k=200), torch.Generator(device=device)
    tokens = stream(model.eval(), torch.tensor([prompt], device=device), sampling, vocab_size=vocab_size,
                    generator=generator.manual_seed(seed), decode_step=step)
    new = list(itertools.takewhile(lambda token: not stop, tokens))     # (1,) each, on the device
    return prompt + (torch.cat(new).tolist() if new else [])


def timed_stream(model, idx, max_new_tokens, kv_cache=True, decode_step=None,
                 kv_dtype=None, pad=None, share_prefix=True) -> tuple[float, float]:
    """(seconds to the first token, seconds for the rest) of one greedy generation of every row
    of idx (B, T), left-padded by `pad` (B,) or not."""
    clock = synchronized_clock(idx.device)
    t0 = clock()
    tokens = stream(model, idx, Sampling(max_new_tokens, temperature=0), kv_cache=kv_cache,
                    decode_step=decode_step, kv_dtype=kv_dtype, pad=pad, share_prefix=share_prefix)
    next(tokens)
    t1 = clock()
    for _ in tokens:
        pass
    return t1 - t0, clock() - t1


@torch.no_grad()
def decode_tokens_per_s(model, batch_size: int, context: int, kv_dtype=None, steps: int = 8) -> float:
    """Tokens/s of eager one-token steps at the end of a `context`-long cache stored in kv_dtype,
    after as many warm-up steps. The cache is filled with random numbers instead of a prefill,
    which would cost far more than the measurement (speed does not depend on them)."""
    check_integer(steps, "steps", 1)
    check_integer(context, "context", 2 * steps, model.config.block_size)
    cache = model.new_kv_cache(batch_size, context, dtype=kv_dtype)
    for t in cache.buffers:
        t.normal_() if t.is_floating_point() else t.random_(-127, 128)
    cache.advance(context - 2 * steps)
    token = torch.zeros(batch_size, 1, dtype=torch.long, device=model.wte.weight.device)
    for _ in range(steps):  # warm-up
        model(token, kv_cache=cache)
    clock = synchronized_clock(token.device)
    t0 = clock()
    for _ in range(steps):
        model(token, kv_cache=cache)
    return batch_size * steps / (clock() - t0)
