"""Producing tokens from a GPT: loading a checkpoint to decode, sampling, batched prompts, the
cached and uncached streams, the compiled one-token decode step, and timing.

    model, ckpt = load_model("outputs/<run>")               # its best.pt, ready to decode
    generate(model, idx, 100, temperature=0.8, top_k=200)   # prompt + 100 new tokens
    for token in stream(model, idx, 100): ...               # (B,) new tokens, one step at a time

With and without the cache the same tokens come out while prompt + new tokens fit in block_size
(past it the uncached reference crops the context at every step, the cache refills from the last
block_size // 2); each row of a batch is generated exactly as its prompt would be alone.
"""

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from model.device import DTYPES, decode_precision, pick_device, synchronized_clock
from model.quantize import quantize_int8


def load_model(path, device="auto", dtype: str = "auto", quantize: str | None = "auto"):
    """(the GPT of the checkpoint at `path` (a run dir's best.pt, else ckpt.pt) ready to decode,
    as `for_decoding` makes it; the Checkpoint)."""
    from model.checkpoint import load, load_weights  # (checkpoint imports gpt, which imports this)
    from model.gpt import GPT

    ckpt = load(path, prefer="best.pt")
    model = GPT(ckpt.model_config)
    load_weights(model, ckpt.model)
    return for_decoding(model, device, dtype, quantize), ckpt


def for_decoding(model, device="auto", dtype: str = "auto", quantize: str | None = "auto"):
    """The model in eval mode on `device`, in the precision `decode_precision` picks (int8
    weights when it says so)."""
    device = pick_device(device) if isinstance(device, str) else device
    dtype, quantize = decode_precision(device, dtype, quantize, model.num_params())
    if quantize == "int8":
        quantize_int8(model)
    return model.to(device=device, dtype=DTYPES[dtype]).eval()


def check_sampling(*, max_new_tokens=0, temperature=1.0, top_k=None, top_p=None) -> None:
    """The sampling options' ranges; each message names the option."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not temperature >= 0 or math.isinf(temperature):
        raise ValueError(f"temperature must be >= 0 and finite, got {temperature}")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1 or null, got {top_k}")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def sample_next(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """One token per row from logits (B, vocab): greedy at temperature 0, else softmax sampling
    restricted to the top_k tokens and to the smallest set whose probability reaches top_p.
    `generator` is one torch.Generator for the batch, or a list of one per row: then each row
    draws exactly what it would draw alone with its generator. The options are `stream`'s to check."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
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
        return torch.cat([torch.multinomial(p, 1, generator=g) for p, g in zip(probs, generator)])  # (B,)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def left_pad(prompts, device):
    """A (B, T) tensor as is, or a list of 1-D prompts left-padded with zeros into one.
    Returns (idx, pad) where pad (B,) counts the padding of each row, or None."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dim() != 2 or prompts.size(1) == 0:
            raise ValueError(f"prompts must be (B, T) with T >= 1, got shape {tuple(prompts.shape)}")
        return prompts.to(device), None
    rows = [torch.as_tensor(p, dtype=torch.long).flatten() for p in prompts]
    if not rows or min(len(r) for r in rows) == 0:
        raise ValueError("every prompt needs at least one token")
    T = max(len(r) for r in rows)
    idx = torch.zeros(len(rows), T, dtype=torch.long)                   # (B, T)
    for b, r in enumerate(rows):
        idx[b, T - len(r):] = r
    pad = torch.tensor([T - len(r) for r in rows], device=device)      # (B,)
    return idx.to(device), pad if pad.any() else None


@torch.no_grad()
def generate(model, idx, max_new_tokens, *, temperature=1.0, top_k=None, top_p=None,
             kv_cache=True, generator=None, vocab_size=None, decode_step=None, kv_dtype=None):
    """Sample max_new_tokens after the prompt(s). `idx` is a (B, T) tensor, or a list of 1-D
    prompts of different lengths. Returns prompt + new tokens: a (B, T + max_new_tokens)
    tensor, or for a list, a list of 1-D tensors. temperature=0 is greedy. The other options
    are `stream`'s."""
    prompts, pad = left_pad(idx, model.wte.weight.device)
    new = list(stream(model, prompts, max_new_tokens, temperature=temperature, top_k=top_k,
                      top_p=top_p, kv_cache=kv_cache, generator=generator, pad=pad, vocab_size=vocab_size,
                      decode_step=decode_step, kv_dtype=kv_dtype))
    out = torch.cat([prompts, *(t[:, None] for t in new)], dim=1)  # (B, T + max_new_tokens)
    if isinstance(idx, torch.Tensor):
        return out
    pads = [0] * len(out) if pad is None else pad.tolist()  # None: the prompts had one length
    return [row[p:] for row, p in zip(out, pads)]


@torch.no_grad()
def stream(model, idx, max_new_tokens, *, temperature=1.0, top_k=None, top_p=None,
           kv_cache=True, generator=None, pad=None, decode_step=None, vocab_size=None, kv_dtype=None):
    """Yield the next token of every row, (B,), max_new_tokens times.

    Without the cache, each step runs the whole context, cropped to block_size: the reference.
    With it, the prompt is prefilled once and each step feeds one token to a static KVCache,
    stored in `kv_dtype` (torch.float32, bfloat16 or int8; default: the model's dtype). When the
    cache is full, `make_room` refills it, so generation goes on past block_size for learned and
    RoPE positions alike. A sliding-window model with RoPE needs neither: its reference is the
    whole context, and its cache a ring of window slots. `decode_step` (a `CompiledDecodeStep`)
    replaces the eager one-token step, and its static cache (of its own kv_dtype) the one
    allocated per call. `vocab_size` limits sampling to the ids below it (a tokenizer's, when the
    model's vocabulary is padded past it).
    """
    check_sampling(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p)
    block_size, context_len = model.config.block_size, model.config.max_positions
    B, T = idx.shape
    if model.config.attn_window is not None and context_len is not None and T + max_new_tokens > block_size:
        raise ValueError(f"{T} prompt + {max_new_tokens} new tokens exceed block_size={block_size}: past "
                         f"it, a sliding-window model (attn_window) needs pos_emb=rope, not learned")
    if isinstance(generator, (list, tuple)) and len(generator) != B:
        raise ValueError(f"generator: a list needs one per row, {B}; got {len(generator)}")
    tokens = torch.empty(B, T + max_new_tokens, dtype=idx.dtype, device=idx.device)  # (B, T + new)
    tokens[:, :T] = idx  # prompt + generated so far: tokens[:, :length], written in place
    length = T
    if decode_step is not None and kv_cache and B > decode_step.cache.batch_size:
        raise ValueError(f"the compiled decode step serves batches of up to {decode_step.cache.batch_size} "
                         f"rows, got {B}")
    if not kv_cache:
        cache = None
    elif decode_step is not None:
        cache = decode_step.cache  # static: its first B rows serve this call
    else:
        cache = model.new_kv_cache(B, min(block_size, T + max_new_tokens), dtype=kv_dtype)
    step = decode_step or (lambda token, cache, pad: model(token, kv_cache=cache, pad=pad)[:, -1])

    # The cache holds the last cache.length tokens; cache_pad (B,) counts the pad slots among them.
    # The model runs in inference mode (no autograd bookkeeping: ~15% faster a step on a CPU); the
    # tokens, sampled outside it, are plain tensors a caller may train on.
    with torch.inference_mode():
        logits, cache_pad = prefill(model, tokens[:, :length], context_len, cache, pad)
    for i in range(max_new_tokens):
        token = sample_next(logits[:, :vocab_size], temperature, top_k, top_p, generator)  # (B,)
        yield token
        if i == max_new_tokens - 1:
            break
        tokens[:, length] = token
        length += 1
        with torch.inference_mode():
            if cache is None:
                logits, _ = prefill(model, tokens[:, :length], context_len, None, pad)
                continue
            if cache.length == cache.max_len and not cache.ring:
                cache_pad = make_room(model, tokens[:, :length - 1], cache, cache_pad)
            logits = step(token[:, None], cache, cache_pad)


def prefill(model, tokens, context_len, cache=None, pad=None):
    """Run the last context_len (None: all) of `tokens` (B, length) from scratch, into an emptied
    cache if one is given: (the logits (B, vocab) after it, the padding (B,) of that context or None)."""
    length = tokens.size(1)
    context = tokens[:, max(0, length - (context_len or length)):]       # (B, <= context_len)
    context_pad = None if pad is None else (pad - (length - context.size(1))).clamp(min=0)
    if cache is not None:
        cache.reset()
    return model(context, kv_cache=cache, pad=context_pad)[:, -1], context_pad


def make_room(model, tokens, cache, pad):
    """Free slots in a full cache, as each row would alone. A row whose context fills the cache
    (no pad slot left) keeps its last block_size // 2 - 1 tokens, recomputed at positions from 0;
    with the next token they make the block_size // 2 it restarts from. Every other row keeps its
    whole context, as it would alone, where its cache is not full yet: its keys and values move
    to earlier slots, and its padding shrinks by as much, so their positions stay. tokens
    (B, length) ends with the cached context; pad (B,) or None. Returns the new pad."""
    keep = max(model.config.block_size // 2, 1) - 1
    padding = torch.zeros(tokens.size(0), dtype=torch.long, device=tokens.device) if pad is None else pad
    full = padding == 0                                                  # (B,)
    kept = torch.where(full, keep, cache.length - padding)               # (B,) tokens each row keeps
    n = int(kept.max())
    if pad is None:  # every row restarts: nothing to move
        cache.reset()
        cache.advance(n)
    else:
        cache.keep_last(n)
    if keep:
        rows = full.nonzero().squeeze(1)                                 # (rows,)
        refill = model.new_kv_cache(len(rows), keep, dtype=cache.dtype)
        model(tokens[rows, -keep:], kv_cache=refill)
        cache.write_rows(rows, n - keep, refill)
    return None if pad is None else n - kept


def decode_backends(device: torch.device) -> list[SDPBackend]:
    """The SDPA kernels a compiled decode step may use. On CPU, one query against the cache is
    faster as SDPA's math formulation (which inductor fuses) than through its flash kernel."""
    if device.type == "cpu":
        return [SDPBackend.MATH]
    return [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
            SDPBackend.MATH]


class CompiledDecodeStep:
    """The one-token step compiled once for a model, with one static KV cache (block_size slots, or
    a ring of the model's window; batch_size rows; stored in kv_dtype) that every `stream` given
    this step reuses. Nothing the graph reads changes shape or address: the cache, the token, the
    pad and the position are tensors allocated here and written in place (`stream` fills the rows a
    smaller batch leaves free; their outputs are dropped). So every prompt length, number of new
    tokens and batch up to batch_size runs the one graph, and on CUDA it is a CUDA graph: the
    static buffers are graph inputs that replay in place."""

    def __init__(self, model, batch_size: int = 1, kv_dtype=None):
        device = model.wte.weight.device
        self.cache = model.new_kv_cache(batch_size, dtype=kv_dtype)
        self.token = torch.zeros(batch_size, 1, dtype=torch.long, device=device)   # (batch_size, 1)
        self.pad = torch.zeros(batch_size, dtype=torch.long, device=device)        # (batch_size,)
        self.input_pos = torch.zeros(1, dtype=torch.long, device=device)           # (1,) the slot written
        for buffer in [*self.cache.buffers, *self.cache.read_buffer.values(), self.token, self.pad,
                       self.input_pos]:
            torch._dynamo.mark_static_address(buffer)
        self.on_cuda, backends = device.type == "cuda", decode_backends(device)

        def logits_at(token, input_pos, cache, pad):
            with sdpa_kernel(backends):
                return model.logits_at(token, input_pos, cache, pad)

        # A code object of its own: dynamo keeps the graphs of one code object together, up to its
        # recompile limit (8; with fullgraph, the 9th is an error), and every step of another model
        # shape or batch size would add one to a shared one. Each step has exactly one graph.
        logits_at.__code__ = logits_at.__code__.replace()
        self.compiled = torch.compile(logits_at, mode="reduce-overhead" if self.on_cuda else None,
                                      dynamic=False, fullgraph=True)

    def __call__(self, token, cache, pad=None):
        """The logits (B, vocab) after token (B, 1), B <= batch_size, at slot cache.length."""
        B = token.size(0)
        self.token[:B] = token
        self.pad[:B] = 0 if pad is None else pad
        self.input_pos.fill_(cache.length)                               # a kernel, not a host copy
        if self.on_cuda:
            torch.compiler.cudagraph_mark_step_begin()  # the last step's logits have been read
        logits = self.compiled(self.token, self.input_pos, cache, self.pad)  # (batch_size, 1, vocab)
        cache.advance(1)
        return logits[:B, -1]


def timed_stream(model, idx, max_new_tokens, kv_cache=True, decode_step=None,
                 kv_dtype=None) -> tuple[float, float]:
    """(seconds to the first token, seconds for the rest) of one greedy generation."""
    clock = synchronized_clock(idx.device)
    t0 = clock()
    tokens = stream(model, idx, max_new_tokens, temperature=0, kv_cache=kv_cache, decode_step=decode_step,
                    kv_dtype=kv_dtype)
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

