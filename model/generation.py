"""Producing tokens from a GPT: loading a checkpoint to decode, sampling, batched prompts, the
cached and uncached streams, the compiled one-token decode step, timing, and recording a decode
(its cache slots and attention weights, step by step) for the inspect page.

    model, ckpt = load_model("outputs/<run>")                # its best.pt, ready to decode
    generate(model, idx, 100, temperature=0.8, top_k=200)    # prompt + 100 new tokens
    for token in stream(model, idx, Sampling(100)): ...      # (B,) new tokens, one step at a time

With and without the cache the same tokens come out while prompt + new tokens fit in block_size
(past it the uncached reference crops the context at every step, the cache refills from the last
block_size // 2); each row of a batch is generated exactly as its prompt would be alone.
"""

import contextlib
import dataclasses
import functools
import getpass
import hashlib
import itertools
import math
import os
import tempfile
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from model.attention import SplitKV
from model.checkpoint import load, load_weights
from model.config import check_integer, is_real
from model.device import AUTO_PRECISION, DTYPES, Precision, pick_device, synchronized_clock
from model.gpt import GPT
from model.kv_cache import storage_dtype
from model.quantize import quantize_int8

FLOAT32_MAX = torch.finfo(torch.float32).max


def load_model(path, device="auto", precision: Precision = AUTO_PRECISION):
    """A checkpoint's GPT ready to decode, and the checkpoint: `path` is a checkpoint file or a
    run dir (its best.pt, else ckpt.pt); the model is on `device`, in eval mode, in the precision
    `for_decoding` gives it."""
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


@torch.no_grad()
def stream(model, idx, sampling: Sampling, *, kv_cache=True, generator=None, pad=None, decode_step=None,
           vocab_size=None, kv_dtype=None, prefill_chunk=None, share_prefix=True):
    """Yield the next token of every row, (B,), as `sampling` draws them: max_new_tokens times.

    Without the cache, each step runs the context from scratch (`prefill`): the reference. With
    it, the prompt is prefilled once and each step feeds one token to a static KVCache, stored in
    `kv_dtype` (float32, bfloat16 or int8; default: the model's dtype). When the cache is full,
    `make_room` refills it, so learned and RoPE positions alike generate past block_size. A model
    whose every layer has a window, with RoPE, needs neither: its reference is the whole context (of
    which the last `receptive_field` tokens matter, or with sinks the first ones too), its cache
    rings. The prompt goes in `prefill_chunk` tokens at a time (None: at once); rows sharing a
    prompt prefix compute it once (`share_prefix`). `decode_step` (a `CompiledDecodeStep`)
    replaces the eager one-token step, and its static cache the one allocated per call. `vocab_size`
    limits sampling to the ids below it (a tokenizer's). The arguments that depend on the model are
    checked here, once (the Sampling was when it was made)."""
    decode_step = decode_step if kv_cache else None  # no cache, no decode step
    kv_dtype = check_generation(model, idx, sampling, generator=generator, vocab_size=vocab_size,
                                decode_step=decode_step, kv_dtype=kv_dtype, pad=pad,
                                prefill_chunk=prefill_chunk)
    c, max_new_tokens = model.config, sampling.max_new_tokens
    B, T = idx.shape
    # tokens[:, :length]: the prompt and the tokens so far, written in place; when it is full, only
    # the last `history` stay (all any step reads again), moved to the front, and pad moves with them.
    history = c.context_size or T + max_new_tokens
    tokens = torch.empty(B, min(T + max_new_tokens, max(T, 2 * history)), dtype=idx.dtype,
                         device=idx.device)                              # (B, capacity)
    tokens[:, :T] = idx
    length = T
    cache = None if decode_step is None else decode_step.cache  # static: its first B rows serve this call
    if kv_cache and cache is None:
        cache = model.new_kv_cache(B, min(c.block_size, T + max_new_tokens), dtype=kv_dtype)
    step = decode_step or (lambda token, cache, pad: model(token, kv_cache=cache, pad=pad)[:, -1])
    # On CUDA the decode step draws the next token itself, inside its CUDA graph (None where it cannot).
    step_draws = decode_step.sampler(sampling, vocab_size, generator, B) if decode_step is not None else None

    # cache_pad (B,): the pad slots among the cache's. Inference mode (~15% faster a step on a CPU),
    # no cuDNN attention; the tokens, sampled outside it, are plain tensors one may train on.
    no_cudnn = CudnnAttentionOff()
    with torch.inference_mode(), no_cudnn:
        logits, cache_pad = prefill(model, tokens[:, :length], cache, pad, prefill_chunk, share_prefix)
    token = sample_next(logits[:, :vocab_size], sampling, generator) if max_new_tokens else None  # (B,)
    for i in range(max_new_tokens):
        yield token
        if i == max_new_tokens - 1:
            break
        if length == tokens.size(1):
            tokens[:, :history] = tokens[:, length - history:length].clone()
            pad = None if pad is None else pad - (length - history)     # (B,) negative: cut off
            length = history
        tokens[:, length] = token
        length += 1
        with torch.inference_mode(), no_cudnn:
            if cache is None:
                logits, _ = prefill(model, tokens[:, :length], None, pad)
            else:
                if cache.length == cache.max_len and not cache.ring:
                    cache_pad = make_room(model, tokens[:, :length - 1], cache, cache_pad, prefill_chunk)
                logits = (step_draws or step)(token[:, None], cache, cache_pad)  # (B, vocab), or drawn: (B,)
        token = logits.clone() if step_draws else sample_next(logits[:, :vocab_size], sampling, generator)


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


def prefill(model, tokens, cache=None, pad=None, chunk=None, share_prefix=True):
    """Run from scratch the part of `tokens` (B, length) the next token depends on, into an
    emptied cache if one is given: (the logits (B, vocab) after it, the pad (B,) of that context or
    None). With learned positions or a layer over the whole context that is the last block_size
    tokens, from position 0: past block_size, the reference's context slides. With windows and
    RoPE, the last receptive_field tokens at the positions they have in the whole sequence (their pad
    lowered by the tokens cut, below 0 once a row's padding is all cut): what the whole context
    computes; with sinks, all of it. Into a cache, `chunk` tokens at a time, and a prompt prefix
    every row shares (`share_prefix`; num_samples of one prompt share all of it) computed once."""
    c, length = model.config, tokens.size(1)
    context = tokens[:, max(0, length - (c.context_size or length)):]    # (B, <= that)
    cut = length - context.size(1)
    if c.max_positions is not None:
        context_pad = None if pad is None else (pad - cut).clamp(min=0)  # (B,)
    elif pad is not None or cut:
        context_pad = (tokens.new_zeros(tokens.size(0)) if pad is None else pad) - cut  # (B,)
    else:
        context_pad = None
    if cache is None:
        return model(context, pad=context_pad, last_only=True)[:, -1], context_pad
    cache.reset()
    shared = shared_prefix(context, context_pad) if share_prefix else 0
    if not shared:
        return feed(model, context, cache, context_pad, chunk), context_pad
    start = 0 if context_pad is None else int(context_pad[0])
    prefix = model.new_kv_cache(1, shared, dtype=cache.dtype, ring=False)  # plain slots, as cache stores
    logits = feed(model, context[:1, start:start + shared], prefix, None, chunk)  # (1, vocab)
    cache.fill_from(prefix, context.size(0), context_pad)
    if shared == context.size(1):  # every row is this prompt
        return logits.expand(context.size(0), -1), context_pad
    return feed(model, context[:, shared:], cache, context_pad, chunk), context_pad


def shared_prefix(context, pad=None) -> int:
    """How many first tokens every row of `context` (B, T), left-padded by `pad`, has in common: 0
    for a single row, or rows cut from longer sequences (a negative pad)."""
    B, T = context.shape
    if B == 1 or (pad is not None and int(pad.min()) < 0):
        return 0
    starts = context.new_zeros(B) if pad is None else pad                # (B,)
    n = T - int(starts.max())                                            # the shortest row's length
    first = context.gather(1, starts[:, None] + torch.arange(n, device=context.device))  # (B, n)
    same = (first == first[:1]).all(dim=0)                               # (n,)
    return int(same.int().cumprod(dim=0).sum())


def feed(model, tokens, cache, pad=None, chunk=None):
    """Write tokens (B, T) into the cache after what it holds, `chunk` at a time (None: all at once,
    up to block_size); the logits (B, vocab) after the last. Past block_size (a ring's prompt, of any
    length) block_size at a time, the same numbers as at once: the attention of a pass is T x (the
    cache's slots + T), its mask and a sink logit's bias per head too, bounded so, not T x T."""
    step = min(tokens.size(1), model.config.block_size) if chunk is None else chunk
    for i in range(0, tokens.size(1), step):
        logits = model(tokens[:, i:i + step], kv_cache=cache, pad=pad, last_only=True)
    return logits[:, -1]


def make_room(model, tokens, cache, pad, chunk=None):
    """Free slots in a full cache, as each row would alone. A row whose context fills the cache
    (no pad slot left) keeps its last block_size // 2 - 1 tokens, recomputed at positions from 0;
    with the next token they make the block_size // 2 it restarts from. Every other row keeps its
    whole context at the positions it has, as it would alone, where its cache is not full yet.
    Both are written again from the tokens, left-padded (`chunk` at a time): every cache kind
    refills one way. tokens (B, length) ends with the cached context; pad (B,) or None. Returns the
    new pad."""
    keep = max(model.config.block_size // 2, 1) - 1
    padding = torch.zeros(tokens.size(0), dtype=torch.long, device=tokens.device) if pad is None else pad
    kept = torch.where(padding == 0, keep, cache.length - padding)       # (B,) tokens each row keeps
    n = int(kept.max())
    new_pad = n - kept                                                   # (B,)
    new_pad = new_pad if new_pad.any() else None
    cache.reset()
    if n:
        feed(model, tokens[:, tokens.size(1) - n:], cache, new_pad, chunk)
    return new_pad


def decode_backends(device: torch.device) -> list[SDPBackend]:
    """The SDPA kernels a decode may use, in the order it prefers them: never cuDNN's attention,
    which builds an execution plan per exact shape (~50 ms each on an H200), where an eager decode's
    key length grows by one a token (`stream` runs every eager pass under `CudnnAttentionOff`).
    Flash takes a call without a mask (a prompt, one query over a plain cache) and, on a CPU, one
    with a mask too; on CUDA memory-efficient attention takes a masked call (the static step's
    unwritten slots, padding, a ring), at any head width that is a multiple of 8 (MLA's 288 too);
    `attend` folds GQA's query heads so that none needs enable_gqa. The CPU's compiled step runs
    flash too, not SDPA's math formulation: compiled, math's one-query product becomes a loop over
    the keys into which inductor inlines whatever made the query (RoPE's pow and cos), recomputed
    for every key (at batch 64 over 1,024 positions of a RoPE model, 860 tokens/s against flash's
    2,925 and the eager step's 2,511; benchmarks/RESULTS.md)."""
    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class CudnnAttentionOff:
    """A context in which SDPA never picks cuDNN's attention (decode_backends says why), restored
    on exit. A flag, not sdpa_kernel's priority list: entering and leaving it costs ~1 µs a token
    on a 2-core CPU, sdpa_kernel's ~37 µs (4% of the CPU's eager step of a tiny model)."""

    def __enter__(self):
        self.was = torch.backends.cuda.cudnn_sdp_enabled()
        torch.backends.cuda.enable_cudnn_sdp(False)

    def __exit__(self, *exc):
        torch.backends.cuda.enable_cudnn_sdp(self.was)


STEP_BACKENDS = ("inductor", "aot_eager", "cuda_graph")


class CompiledDecodeStep:
    """The one-token step built once for a model, with one static KV cache (block_size slots per
    layer, or a ring of its window and sinks; batch_size rows; stored in kv_dtype) that every
    `stream` given this step reuses. The cache, the token, the pad and the position are tensors
    allocated here and written in place (`stream` fills the rows a smaller batch leaves free; their
    outputs are dropped), so every prompt length, number of new tokens and batch up to batch_size
    runs one graph. `backend` says how:

        cuda_graph  the eager step captured once as a CUDA graph and replayed (CUDA only): no code
                    generated, captured in well under a second; `generate.py`'s default on CUDA
        inductor    torch.compile generates the step's code (fused kernels), on CUDA captured as a
                    CUDA graph too: seconds to compile, the fastest step once compiled
        aot_eager   torch.compile traces the same graph and runs it eagerly: a quick check of the
                    traced step (tests, the GPU plan's smoke run)

    On CUDA nothing the step reads changes shape (a CUDA graph replays fixed shapes): it reads every
    slot of the cache, unwritten ones masked, and it draws the next token inside the graph too
    (`sampler`): the host launches one graph a token, with no guard of torch.compile's run per
    token. With `split_kv` (by default when inductor compiles the step) its one-query attention is
    split across the GPU's multiprocessors (`attend_split_kv`; on an H200, GPT-2 124M's batch-1
    step ran 1,748 tokens/s against SDPA's 863); the cuda_graph step uses SDPA's kernels unless
    asked (its split-KV attention would compile, seconds at start, for ~0.1 s over 500 tokens of
    the char model). On a CPU it reads the slots written so far, as the eager step does, in a graph
    compiled once for any number of them (one dynamic dimension), called with no guard of
    torch.compile's checked (as a CUDA graph checks none: the step is its model's and its cache's).
    An int8 model's CPU step is compiled ahead of time instead (`ahead_of_time`): its weights frozen
    in, kept on disk as an AOTInductor package that a later process loads in milliseconds, and run
    by the package's C++ runner with no Python of torch.compile's around it (the main job's step:
    164 µs against 340). The step is built and run once when made (compiling, capturing), so that
    whatever that prints comes before a sample's text."""

    def __init__(self, model, batch_size: int = 1, kv_dtype=None, backend: str = "inductor",
                 split_kv: bool | None = None):
        device = model.wte.weight.device
        check_integer(batch_size, "batch_size", 1)
        if backend not in STEP_BACKENDS or (backend == "cuda_graph" and device.type != "cuda"):
            raise ValueError(f"backend must be one of {', '.join(STEP_BACKENDS)} (cuda_graph on CUDA), got "
                             f"{backend!r} for a model on {device.type}")
        self.model, self.split_kv = model, backend == "inductor" if split_kv is None else split_kv
        # On a CPU, inductor's step of an int8 model is compiled ahead of time, its weights frozen in
        self.frozen = backend == "inductor" and device.type == "cpu" and int8_weights(model)
        self.cache = model.new_kv_cache(batch_size, dtype=None if kv_dtype is None else
                                        storage_dtype(kv_dtype, "kv_dtype"))
        self.token = torch.zeros(batch_size, 1, dtype=torch.long, device=device)   # (batch_size, 1)
        self.pad = torch.zeros(batch_size, dtype=torch.long, device=device)        # (batch_size,)
        self.input_pos = torch.zeros(1, dtype=torch.long, device=device)           # (1,) the slot written
        self.backend = backend
        # SDPA's kernels, set around every call that compiles or captures the step (not inside the
        # traced function: a priority set there keeps AOTAutograd's cache from storing the step,
        # and each process would compile it again, ~1 s of a CPU's start).
        self.kernels = functools.partial(sdpa_kernel, decode_backends(device), set_priority=True)
        self.inputs = (self.token, self.input_pos, self.cache, self.pad)
        # On a CPU, a cache that is not one ring is read up to its last written slot: the step
        # takes slots[:n], whose size n is its one dynamic dimension. (A ring reads every slot.)
        reads_written = device.type != "cuda" and not self.cache.ring
        self.slots = torch.empty(self.cache.max_len, device=device) if reads_written else None

        def logits_at(token, input_pos, cache, pad, slots=None):
            return model.logits_at(token, input_pos, cache, pad, None if slots is None else slots.size(0))

        with warnings.catch_warnings(), torch.inference_mode(), self.kernels():
            # float32 is asked for, not TF32 (inductor advises it): the advice is not the user's concern
            warnings.filterwarnings("ignore", message=".*TensorFloat32 tensor cores")
            # nor is autotune's own use of a deprecated storage API (timing an int8 step's products)
            warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
            if device.type == "cuda":
                self.run = self.captured(logits_at if backend == "cuda_graph" else
                                         self.compiled(logits_at, backend))
            else:
                self.run = (self.ahead_of_time(logits_at) if self.frozen else
                            self.compiled_reading_written(self.compiled(logits_at, backend), logits_at))
                # Compiled now, not at a sample's first token: with 2 slots read (sizes 0 and 1 would
                # be compiled as constants).
                self.cache.advance(min(1, self.cache.max_len - 1))
                self(self.token, self.cache)
                self.cache.reset()

    def compiled(self, logits_at, backend: str):
        """logits_at compiled by torch.compile's `backend`: one fixed-shape graph (on CUDA, captured
        as a CUDA graph after), or on a CPU one whose `slots` size is dynamic."""
        on_cpu = self.token.device.type == "cpu"
        if not on_cpu:  # a CUDA graph reads its inputs where they were captured: no copy in
            for buffer in [*self.cache.buffers, *self.cache.read_buffer.values(), self.token, self.pad,
                           self.input_pos]:
                torch._dynamo.mark_static_address(buffer)
        # A code object of its own: dynamo keeps the graphs of one code object together, up to its
        # recompile limit (8; with fullgraph, the 9th is an error), and every step of another model
        # shape or batch size would add one to a shared one. Each step has exactly one graph.
        logits_at.__code__ = logits_at.__code__.replace()
        # No guard runs per call: like a CUDA graph, the step serves one model and one cache, whose
        # tensors it reads in place, with the sizes it was compiled for (`run` sends it no other).
        # Dynamo's ~500 guards (every parameter, module attribute and global it reads) cost the main
        # job's 4-layer CPU step about a quarter of its time. On a CPU, inductor's wrapper around
        # its kernels is C++ too (cpp_wrapper): another fifth.
        options = {"guard_filter_fn": torch.compiler.skip_all_guards_unsafe}
        if backend == "inductor" and on_cpu:
            options["cpp_wrapper"] = True
        # dynamic=None: a size that changes is compiled as a dynamic one (only `slots`' can)
        return torch.compile(logits_at, backend=backend, dynamic=None if self.slots is not None else False,
                             fullgraph=True, options=options)

    def compiled_reading_written(self, step, logits_at):
        """run(reads) on a CPU: the compiled step over the first `reads` slots (all of them for a ring)."""
        compiled = False

        def run(reads: int):
            nonlocal compiled
            if self.slots is None:
                return step(*self.inputs)
            slots = self.slots[:reads]                                     # (reads,)
            if reads < 2:  # 1 slot (a refill that kept no token): a size dynamo makes a constant
                with self.kernels():
                    return logits_at(*self.inputs, slots)  # so it runs eagerly
            # The first call compiles the graph for every number in 2 .. max_len: the whole cache too,
            # which comes once a refill (eager, the main job's step took 3 ms there; compiled, 0.4)
            if not compiled:
                torch._dynamo.mark_dynamic(slots, 0)
                compiled = True
            return step(*self.inputs, slots)

        return run

    def ahead_of_time(self, logits_at):
        """run(reads) on a CPU for an int8 model: the step exported (torch.export) and compiled by
        AOTInductor with its weights frozen in (inductor's own C++ int8 products), kept on disk as a
        package (`step_package`) that a later process loads in milliseconds, and called through
        the package's C++ runner: no dynamo, AOTAutograd or guard between two steps. A number of
        slots outside those it was exported for (below 2, or where export specialised) runs eagerly."""
        path = step_package(self.model, self.cache)
        reads_written = self.slots is not None
        # a ring reads every slot: its `slots` input is a placeholder of fixed size
        slots = self.slots[:max(2, self.cache.max_len - 1)] if reads_written else self.token.new_empty(0)
        tensors = self.cache.tensors
        if not path.exists():
            export_step(self.model, self.cache, (self.token, self.input_pos, self.pad, slots, tensors),
                        reads_written, path, self.kernels)
        # The package's own runner, not torch._inductor.aoti_load_package: that imports inductor (~3 s)
        runner = torch._C._aoti.AOTIModelPackageLoader(str(path), "model", False, 1, -1)
        low, high = (int(n) for n in runner.get_metadata()["reads"].split())
        inputs = [self.token, self.input_pos, self.pad, slots, *tensors]

        def run(reads: int):
            if reads_written and not low <= reads <= high:
                with self.kernels():
                    return logits_at(*self.inputs, self.slots[:reads])
            if reads_written:
                inputs[3] = self.slots[:reads]                             # (reads,)
            return runner.run(inputs)[0]

        return run

    def captured(self, logits_at):
        """run(reads) on CUDA: logits_at over the static inputs captured as a CUDA graph (`capture`),
        each call a replay whose logits are written to the same tensor."""
        self.body, self.sampling_graphs = logits_at, {}
        graph, logits = self.capture(lambda: logits_at(*self.inputs))    # (batch_size, 1, vocab)
        self.graph = graph  # (kept alive with its memory pool)

        def run(reads: int):
            graph.replay()
            return logits

        return run

    def capture(self, body, generator=None, restore_rng=False):
        """(a CUDA graph of body(), what body returned): warmed up twice on a side stream (as capturing
        needs: lazy initialisations; torch.compile's or an int8 cache's kernel compiled), then
        recorded once, in a memory pool of its own, with attention split across the GPU (split_kv)
        and SDPA's kernels in the step's order (decode_backends).
        With restore_rng the warm-ups leave `generator` (None: CUDA's default) as they found it, and
        the graph advances it at every replay as the eager draws would."""
        split = SplitKV() if self.split_kv else contextlib.nullcontext()
        if restore_rng:  # (the warm-ups draw too)
            rng = torch.cuda.get_rng_state() if generator is None else generator.get_state()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), split, self.kernels():
            for _ in range(2):
                body()
        torch.cuda.current_stream().wait_stream(side)
        if restore_rng:
            torch.cuda.set_rng_state(rng) if generator is None else generator.set_state(rng)
        graph = torch.cuda.CUDAGraph()
        if generator is not None:
            graph.register_generator_state(generator)
        with split, self.kernels(), torch.cuda.graph(graph):
            out = body()
        return graph, out

    def sampler(self, sampling: Sampling, vocab_size, generator, B: int):
        """On CUDA, a step that also draws the next tokens, (token (B, 1), cache, pad) -> (B,): one
        CUDA graph of the step and `sample_next` (greedy, temperature, top-k, top-p, `generator`),
        captured on the first call for each way of sampling and batch size (the draws of a smaller
        batch are others), kept for the 4 latest. The same tokens as sampling after the step's logits,
        seeded too. None on a CPU, or for a list of generators (one per row: drawn after the step)."""
        if self.token.device.type != "cuda" or isinstance(generator, (list, tuple)):
            return None
        key = (B, sampling.temperature, sampling.top_k, sampling.top_p, vocab_size, generator)
        if key not in self.sampling_graphs:
            if len(self.sampling_graphs) == 4:
                del self.sampling_graphs[next(iter(self.sampling_graphs))]
            with torch.inference_mode():
                logits = lambda: self.body(*self.inputs)[:B, -1, :vocab_size]  # noqa: E731  (B, vocab)
                self.sampling_graphs[key] = self.capture(lambda: sample_next(logits(), sampling, generator),
                                                         generator, restore_rng=True)
        graph, drawn = self.sampling_graphs[key]                         # drawn: (B,)

        def step_and_draw(token, cache, pad=None):
            self.write_inputs(token, cache, pad)
            graph.replay()
            cache.advance(1)
            return drawn

        return step_and_draw

    def write_inputs(self, token, cache, pad=None):
        """token (B, 1), B <= batch_size, pad (B,) or None and the slot cache.length to the static inputs."""
        B = token.size(0)
        self.token[:B] = token
        self.pad[:B] = 0 if pad is None else pad
        self.input_pos.fill_(cache.length)                               # a kernel, not a host copy

    def __call__(self, token, cache, pad=None):
        """The logits (B, vocab) after token (B, 1), B <= batch_size, at slot cache.length: read them
        before the next call, which writes over them."""
        self.write_inputs(token, cache, pad)
        logits = self.run(min(cache.length + 1, cache.max_len))          # (batch_size, 1, vocab)
        cache.advance(1)
        return logits[:token.size(0), -1]


def int8_weights(model) -> bool:
    """Whether every product of the model's layers is an int8 one (quantize_int8): no nn.Linear left."""
    return not any(isinstance(module, torch.nn.Linear) for module in model.modules())


class ExportedStep(torch.nn.Module):
    """The one-token step as torch.export takes it: the cache's tensors are inputs (a tensor export
    finds on a Python object it keeps as a constant, and the compiled step would write into a copy)."""

    def __init__(self, model, cache, reads_written: bool):
        super().__init__()
        self.model, self.cache, self.reads_written = model, cache, reads_written

    def forward(self, token, input_pos, pad, slots, tensors):
        reads = slots.size(0) if self.reads_written else None
        return self.model.logits_at(token, input_pos, self.cache.over(tensors), pad, reads)


def export_step(model, cache, example, reads_written: bool, path, kernels) -> None:
    """Export the step over `cache` (example: token, input_pos, pad, slots, the cache's tensors) with
    the size of `slots` dynamic from 2 to the cache's length where it reads the written slots (a cache
    of 1 or 2 slots: the example's size alone), and
    compile it with AOTInductor into the package `path`, which records in its metadata the sizes
    export kept dynamic ("low high": a view of the whole cache is contiguous, so export may stop short
    of it)."""
    import torch._inductor
    from torch._inductor.exc import InductorError

    dynamic = reads_written and cache.max_len > 2
    slots_dims = {0: torch.export.Dim.DYNAMIC(min=2, max=cache.max_len)} if dynamic else None
    with kernels(), torch.inference_mode(False), torch.no_grad():
        program = torch.export.export(ExportedStep(model, cache, reads_written), example,
                                      dynamic_shapes=(None, None, None, slots_dims, [None] * len(example[4])))
    slots = next(node for node in program.graph.find_nodes(op="placeholder") if node.name == "slots")
    reads = slots.meta["val"].size(0)                                    # a SymInt where it stayed dynamic
    if isinstance(reads, torch.SymInt):
        bounds = program.range_constraints[reads.node.expr]
        low, high = int(bounds.lower), int(min(bounds.upper, cache.max_len))
    else:
        low = high = reads
    # Inductor's C++ int8 products, untimed: timed against ATen's, they won at every shape measured,
    # and each timing compiled a harness (~3.5 s). Where the template takes no product (this CPU's
    # vector instructions, a shape), inductor refuses the graph: then each is timed against ATen's.
    options = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP",
               "autotune_num_choices_displayed": 0, "max_autotune_report_choices_stats": False,
               "aot_inductor.metadata": {"reads": f"{low} {high}"}}
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.stem}.{os.getpid()}.pt2")  # whole or absent: renamed when written
    try:
        torch._inductor.aoti_compile_and_package(program, package_path=str(partial), inductor_configs=options)
    except InductorError:
        options["max_autotune_gemm_backends"] = "CPP,ATEN"
        torch._inductor.aoti_compile_and_package(program, package_path=str(partial), inductor_configs=options)
    os.replace(partial, path)


def step_package(model, cache) -> Path:
    """Where the AOTInductor package of `model`'s CPU step over `cache` is kept: in inductor's cache
    folder (TORCHINDUCTOR_CACHE_DIR, or its default), under a digest of all the package depends on:
    the weights (frozen in), the config, the cache's shape and dtype, the model's code, PyTorch's
    version and the CPU's vector instructions. Any other model, cache or code gets a package of its own."""
    digest = hashlib.blake2b(weights_digest(model).encode(), digest_size=16)
    shape = [tuple(t.shape) for t in cache.buffers], cache.dtype, cache.compute_dtype
    for part in (repr(model.config), repr(shape), torch.__version__, torch.backends.cpu.get_cpu_capability()):
        digest.update(part.encode())
    for source in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(source.read_bytes())
    default = Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}"  # inductor's own
    folder = os.environ.get("TORCHINDUCTOR_CACHE_DIR") or default
    return Path(folder) / "kvgpt" / f"decode-step-{digest.hexdigest()}.pt2"


def weights_digest(model) -> str:
    """A digest of every weight and buffer of `model`, bytes and names (0.06 s for 43 MB)."""
    digest = hashlib.blake2b(digest_size=16)
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


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


WEIGHT_DECIMALS = 6  # the recorded weights are within 5e-7 of the model's
MAX_WEIGHTS = 2**23  # attention weights one recording may hold: ~8 bytes each in the page, so ~70 MB


def weights_to_record(config, prompt_len: int, max_new_tokens: int) -> int:
    """At most how many attention weights recording `max_new_tokens` tokens after a prompt of
    prompt_len keeps: per token, every head of every layer over at most block_size slots (or, for a
    model without a last position, the whole context)."""
    keys = prompt_len + max_new_tokens
    if config.max_positions is not None:
        keys = min(keys, config.block_size)
    return max_new_tokens * config.n_layer * config.n_head * keys


class DecodeRecorder:
    """A decode seen from the inside, for the page `generate.py inspect=page.html` writes:

        with DecodeRecorder(model, prompt_ids) as recorder:
            for token in recorder.watch(stream(model, idx, sampling)): ...
        recorder.record()  # the model, its cache and one entry per new token, ready for JSON

    After every forward pass of the stream it keeps which position each cache slot holds and which
    slots were just written, where each head of each layer attended (the decode's own weights, laid
    over the slots) and, for an int8 cache, how far the K and V it stored are from those it was
    given. Hooks on the model record the batch's first row, while entered; a decode nobody watches
    runs without them. Entered, every attention layer keeps its weights, which runs it on the naive
    backend (SDPA's function, to float rounding; an int8 cache's step reads the numbers its int8
    values and scales stand for). The stream must run the model's forward (no compiled decode_step),
    and only into its own cache: a batch whose rows share a prompt prefix records with
    share_prefix=False. The first row's left padding is no token: its slots are empty (-1), as a
    row's slots before it is written."""

    def __init__(self, model, prompt):
        self.model, self.tokens, self.prompt_len = model, [int(t) for t in prompt], len(prompt)
        self.steps, self.cache, self.stream_cache = [], None, None
        self.last, self.first_start, self.refilled = None, None, False  # the forwards since the last token

    def __enter__(self):
        for block in self.model.blocks:
            block.attn.keep_weights = True
        self.hooks = [self.model.register_forward_pre_hook(self.before_forward, with_kwargs=True),
                      self.model.register_forward_hook(self.after_forward, with_kwargs=True)]
        return self

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()
        for block in self.model.blocks:
            block.attn.keep_weights, block.attn.weights = False, None

    def watch(self, tokens):
        """`stream`'s steps, (B,) each, passed on as they come; each closes its token's entry."""
        for token in tokens:
            self.close_step(int(token[0]))
            yield token

    def before_forward(self, model, args, kwargs):
        cache = kwargs.get("kv_cache")
        if cache is not None and cache.quantized:
            cache.errors = {}  # filled by each store of this forward

    def after_forward(self, model, args, kwargs, output):
        """What this forward pass left: each group's slots, the last query's weights per layer."""
        T, cache, pad = args[0].size(1), kwargs.get("kv_cache"), kwargs.get("pad")
        if cache is not None and self.stream_cache not in (None, cache):
            raise ValueError("DecodeRecorder records the forward passes into one cache, but its rows share a "
                             "prompt prefix, computed once in a cache of its own: record the stream with "
                             "share_prefix=False")
        self.stream_cache = self.stream_cache or cache
        end = T if cache is None else cache.length       # columns 0 .. end-1 hold the context
        start = end - T                                   # the columns this forward wrote
        row_pad = None if pad is None else pad[:1]        # (1,): the first row's
        shift = len(self.tokens) - end                    # column end-1 holds the latest token
        input_pos = torch.arange(start, end, device=args[0].device)  # (T,)
        groups = [self.held_columns(cache, g, input_pos, end, row_pad)
                  for g in range(1 if cache is None else len(cache.slot_lens))]
        weights = []
        for block in self.model.blocks:
            g = 0 if cache is None else block.attn.kv_slot
            keys = None if cache is None else cache.key_positions(g, input_pos, end, row_pad)
            w = block.attn.weights[0, :, -1].float().cpu()                  # (n_head, S): the last query's
            keys = torch.arange(w.size(-1)) if keys is None else keys.reshape(-1).cpu()  # (S,) columns
            weights.append(over_slots(w, keys, groups[g]))
        if cache is not None:
            self.cache = self.cache or describe_cache(model.config, cache)
            if start == 0 and self.steps:
                self.refilled = True
            self.first_start = start if self.first_start is None else self.first_start
        errors = None  # int8: per group, K's and V's relative error (None: V is inside K)
        if cache is not None and cache.errors is not None:
            errors = [[float(cache.errors[g, name]) if (g, name) in cache.errors else None
                       for name in ("k", "v")] for g in range(len(groups))]
            cache.errors = None
        offset = shift + (0 if pad is None else int(pad[0]))  # the token at position 0
        self.last = dict(shift=shift, offset=offset, start=start, groups=groups, weights=weights,
                         errors=errors)

    @staticmethod
    def held_columns(cache, g, input_pos, end, row_pad) -> torch.Tensor:
        """(slots,): the column each slot of group g holds once `end` are written, -1 for none and
        for the row's padding (its columns before row_pad: no token of its own, the mask hides them);
        for no cache, the context's columns 0 .. end-1."""
        if cache is None:
            held = torch.arange(end)
        else:
            held = cache.key_positions(g, input_pos[-1:], None, row_pad).reshape(-1).cpu()  # (slots,)
        padding = held < (0 if row_pad is None else int(row_pad))  # a negative pad: no column is one
        return held.masked_fill((held >= end) | padding, -1)

    def close_step(self, token: int) -> None:
        """The entry of the token the forward passes since the last one made."""
        last, written_from = self.last, self.first_start
        if last is None:
            raise ValueError("DecodeRecorder saw no forward pass of the model for this token: a compiled "
                             "decode_step runs none; record a stream without one")
        groups = []
        for held in last["groups"]:
            used = int((held >= 0).nonzero().max()) + 1 if (held >= 0).any() else 0
            held = held[:used]
            seq = torch.where(held >= 0, held + last["shift"], -1)
            written = [] if written_from is None else (held >= written_from).nonzero().flatten().tolist()
            groups.append({"seq": seq.tolist(), "written": written})
        weights = []  # [layer][head][slot], over the slots its group uses
        for block, w in zip(self.model.blocks, last["weights"]):
            used = len(groups[0 if self.cache is None else block.attn.kv_slot]["seq"])
            weights.append([[round(x, WEIGHT_DECIMALS) for x in head[:used]] for head in w.double().tolist()])
        self.steps.append({"token": token, "offset": last["offset"], "groups": groups, "weights": weights,
                           "errors": last["errors"], "refill": last["start"] if self.refilled else None})
        self.tokens.append(token)
        self.last, self.first_start, self.refilled = None, None, False

    def record(self) -> dict:
        """Everything recorded, as plain numbers and lists: the model, the cache (None: decoded
        without one), the tokens (prompt, then new) and one entry per new token."""
        c = self.model.config
        return {"model": describe_model(c, self.model.num_params()), "cache": self.cache,
                "tokens": self.tokens, "prompt_len": self.prompt_len, "steps": self.steps}


def over_slots(w: torch.Tensor, keys: torch.Tensor, held: torch.Tensor) -> torch.Tensor:
    """w (n_head, S), the weights over keys at columns `keys` (S,; -1 unseen), laid over the slots
    holding columns `held` (slots,; -1 none): (n_head, slots), 0 where a slot's column was not read."""
    size = int(max(keys.max(), held.max(), 0)) + 1
    key_of_column = torch.full((size,), -1, dtype=torch.long)                  # (columns,)
    seen = keys >= 0
    key_of_column[keys[seen]] = torch.nonzero(seen).flatten()
    key = key_of_column[held.clamp(min=0)]                                     # (slots,)
    read = (held >= 0) & (key >= 0)
    return torch.where(read, w[:, key.clamp(min=0)], 0.0)                      # (n_head, slots)


def describe_model(c, params: int) -> dict:
    """The config fields the page shows, as plain values."""
    return {"params": params, "n_layer": c.n_layer, "n_head": c.n_head, "n_kv_head": c.n_kv_head,
            "head_dim": c.head_dim, "n_embd": c.n_embd, "block_size": c.block_size, "pos_emb": c.pos_emb,
            "mla": None if c.mla_latent_dim is None else {"latent": c.mla_latent_dim, "rope": c.mla_rope_dim},
            "kv_share": c.kv_share, "windows": c.windows, "sinks": c.attn_sinks,
            "sink_logit": c.attn_sink_logit, "layer_group": [i // c.kv_share for i in range(c.n_layer)]}


def describe_cache(c, cache) -> dict:
    """The cache's kind and bytes: the formula's and the tensors' own, per group of layers."""
    groups = [{"slots": n, "ring": ring, "window": window,
               "layers": [i for i in range(c.n_layer) if i // c.kv_share == g],
               "bytes": sum(tensors[g].nbytes for tensors in cache.stored.values())}
              for g, (n, ring, window) in enumerate(zip(cache.slot_lens, cache.rings, cache.windows))]
    return {"dtype": str(cache.dtype).removeprefix("torch."), "itemsize": cache.dtype.itemsize,
            "quantized": cache.quantized, "formula": c.kv_cache_formula(), "sinks": cache.sinks,
            "bytes_per_token": cache.bytes_per_token, "nbytes": cache.nbytes, "rows": cache.batch_size,
            "groups": groups, "scales_bytes": sum(t.nbytes for name, ts in cache.stored.items()
                                                  if name.endswith("_scale") for t in ts)}

