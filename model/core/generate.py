"""Generation: the next token drawn from a GPT's logits (greedy, temperature, top-k, top-p, with a
seeded generator), and `generate`, which feeds each token back in, with the KV cache or without."""

import torch
import torch.nn.functional as F


def sample(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    """One token id per row of logits (B, vocab): the most likely at temperature 0; else drawn from
    softmax(logits / temperature), among the tokens `keep_top` keeps."""
    if temperature == 0:
        return logits.argmax(dim=-1)                                     # (B,)
    probs = F.softmax(keep_top(logits.float() / temperature, top_k, top_p), dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]       # (B,)


def keep_top(logits, top_k=None, top_p=None):
    """logits (B, vocab) with -inf but for the top_k most likely tokens and the fewest whose
    probabilities reach top_p (None: no such limit)."""
    if top_k is not None and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]           # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)  # (B, vocab) each
        probs = F.softmax(sorted_logits, dim=-1)
        drop_sorted = probs.cumsum(dim=-1) - probs >= top_p  # the tokens before it reach top_p already
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return logits


@torch.no_grad()
def generate(model, idx, max_new_tokens, temperature=1.0, top_k=None, top_p=None, kv_cache=True,
             generator=None):
    """idx (B, T) followed by max_new_tokens drawn one at a time (`sample`'s options), as nanoGPT's
    generate: (B, T + max_new_tokens). Without the cache, every step runs the last block_size tokens
    from scratch. With it, the prompt runs once into the cache and each step only the new token;
    a full cache starts again from the last block_size // 2 tokens. Both give the same tokens while
    prompt and new tokens fit in block_size."""
    block_size = model.config.block_size
    cache = model.new_kv_cache(idx.size(0)) if kv_cache else None
    fed = idx[:, -block_size:]  # what the next pass runs: the prompt, then each new token
    for _ in range(max_new_tokens):
        if cache is None:
            logits = model(idx[:, -block_size:])                         # (B, <= block_size, vocab)
        else:
            if cache.length + fed.size(1) > block_size:  # full: refill with the recent tokens
                cache.reset()
                fed = idx[:, -max(block_size // 2, 1):]
            logits = model(fed, kv_cache=cache)
        token = sample(logits[:, -1], temperature, top_k, top_p, generator)  # (B,)
        idx = torch.cat([idx, token[:, None]], dim=1)                    # (B, T + 1)
        fed = token[:, None]                                             # (B, 1)
    return idx
