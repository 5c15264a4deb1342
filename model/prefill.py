"""What decoding adds to the core's prefill and refill (model/core/generate.py): a context run into
the KV cache from scratch. A prompt goes in chunks or at once, a prefix its rows share once."""

import torch


def prefill(model, tokens, cache=None, starts=None, chunk=None, share_prefix=True):
    """(logits (B, vocab), starts (B,) or None) of what of `tokens` (B, length) the next token depends
    on (`context_of`), run from scratch into an emptied cache if given: `chunk` tokens at a time, a
    prefix every row shares (`share_prefix`: num_samples of one prompt) computed once."""
    context, context_starts = context_of(model.config, tokens, starts)
    if cache is None:
        return model(context, starts=context_starts, last_only=True)[:, -1], context_starts
    cache.reset()
    shared = shared_prefix(context, context_starts) if share_prefix else 0
    if context_starts is not None:  # a plain prefix cache holds block_size positions at most
        shared = min(shared, model.config.block_size)
    if not shared:
        return feed(model, context, cache, context_starts, chunk), context_starts
    logits = feed_shared(model, context, cache, context_starts, shared, chunk)  # (1, vocab)
    if shared == context.size(1):  # every row is this prompt
        return logits.expand(context.size(0), -1), context_starts
    return feed(model, context[:, shared:], cache, context_starts, chunk), context_starts


def feed_shared(model, context, cache, starts, shared, chunk=None):
    """The first `shared` tokens of every row of `context` (B, T), after its `starts`, fed once into the
    emptied cache; the logits (1, vocab) after them. Rows of one length: fed for the first row (a
    ring takes any length), copied as stored into the others. Else into one plain row, at most
    block_size of it, which `KVCache.fill_from` places at each row's columns."""
    B = context.size(0)
    if starts is None:
        logits = feed(model, context[:1, :shared], cache, None, chunk)
        for tensor in cache.buffers:                                     # (rows, heads, cells, .)
            written = min(tensor.size(2), cache.sinks + shared)  # (a ring writes from its sink cells on)
            tensor[1:B, :, :written] = tensor[:1, :, :written]
        return logits
    start = int(starts[0])
    prefix = model.new_kv_cache(1, shared, dtype=cache.dtype, ring=False)  # plain groups, as cache stores
    logits = feed(model, context[:1, start:start + shared], prefix, None, chunk)
    cache.fill_from(prefix, B, starts)
    return logits


def context_of(c, tokens, starts=None):
    """(context, its starts (B,) or None): the part of `tokens` (B, length), its rows starting at
    columns `starts`, the next token depends on. With learned positions or a layer over the whole
    context, the last block_size tokens from position 0: past block_size, the reference's context
    slides. With windows and RoPE, the last receptive_field tokens at the positions they have in the
    whole sequence (their starts lowered by the tokens cut, below 0 once a row's padding is all cut);
    with sinks, all of it."""
    length = tokens.size(1)
    context = tokens[:, max(0, length - (c.context_size or length)):]    # (B, <= length)
    cut = length - context.size(1)
    if c.max_positions is not None:
        return context, None if starts is None else (starts - cut).clamp(min=0)  # (B,)
    if starts is not None or cut:
        return context, (tokens.new_zeros(tokens.size(0)) if starts is None else starts) - cut  # (B,)
    return context, None


def shared_prefix(context, starts=None) -> int:
    """How many first tokens every row of `context` (B, T), left-padded by `starts`, has in common: 0
    for a single row, or rows cut from longer sequences (starts below 0)."""
    B, T = context.shape
    if B == 1 or (starts is not None and int(starts.min()) < 0):
        return 0
    starts = context.new_zeros(B) if starts is None else starts                # (B,)
    n = T - int(starts.max())                                            # the shortest row's length
    first = context.gather(1, starts[:, None] + torch.arange(n, device=context.device))  # (B, n)
    same = (first == first[:1]).all(dim=0)                               # (n,)
    return int(same.int().cumprod(dim=0).sum())


def feed(model, tokens, cache, starts=None, chunk=None):
    """Write tokens (B, T) into the cache after what it holds, `chunk` at a time (None: all at once,
    up to block_size); the logits (B, vocab) after the last. Past block_size (a ring's prompt, of any
    length) block_size at a time, the same numbers as at once: the attention of a pass is T x (the
    cache's cells + T), its mask and a sink logit's bias per head too, bounded so, not T x T."""
    step = min(tokens.size(1), model.config.block_size) if chunk is None else chunk
    for i in range(0, tokens.size(1), step):
        logits = model(tokens[:, i:i + step], kv_cache=cache, starts=starts, last_only=True)
    return logits[:, -1]


def make_room(model, tokens, cache, starts, chunk=None):
    """Free cells in a full cache, as each row would alone; returns the new starts (B,) or None. A row
    whose context fills the cache (no padding cell left) keeps its last block_size // 2 - 1 tokens, at
    positions from 0 (with the next token, the block_size // 2 it restarts from); every other row
    keeps its whole context where it is. Both are written again from `tokens` (B, length), which
    ends with the cached context, left-padded, `chunk` at a time: every cache kind refills one way."""
    keep = max(model.config.block_size // 2, 1) - 1
    padding = torch.zeros(tokens.size(0), dtype=torch.long, device=tokens.device) if starts is None \
        else starts
    kept = torch.where(padding == 0, keep, cache.length - padding)       # (B,) tokens each row keeps
    n = int(kept.max())
    new_starts = n - kept                                                   # (B,)
    new_starts = new_starts if new_starts.any() else None
    cache.reset()
    if n:
        feed(model, tokens[:, tokens.size(1) - n:], cache, new_starts, chunk)
    return new_starts
