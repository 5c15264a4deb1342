"""Attention: `attend`, the one core every layer calls, RoPE's rotation of queries and keys, and
`CausalSelfAttention`, the layer in which MHA, GQA and MQA are one class. n_head query heads read
n_kv_head key/value heads: query head h reads K/V head h // (n_head // n_kv_head)."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# Faster kernels the extensions add (model/kernels.py, model/windows.py): each returns its output for
# a call it takes, None for any other. The core alone has none.
KERNELS = []


def attend(q, k, v, attn_mask=None, *, is_causal=True, dropout_p=0.0, scale=None, backend="sdpa",
           return_weights=False):
    """softmax(q k^T * scale + mask) v, for q (B, n_head, T, d_k), k (B, n_kv_head, S, d_k) and
    v (B, n_kv_head, S, d_v) -> (B, n_head, T, d_v); `scale` defaults to 1/sqrt(d_k).

    The queries are the last T of S positions (a prompt, or new tokens after a cache's), so the
    causal mask is bottom-right aligned: query i sees keys 0 .. S-T+i. `attn_mask` (bool, True = may
    attend; or a float added to the scores) broadcasts to (B, n_head, T, S) and joins it; with
    is_causal=False it says it all. backend "sdpa" calls PyTorch's fused kernels; "naive" (or
    return_weights, which also returns the weights (B, n_head, T, S)) computes the formula itself."""
    for kernel in KERNELS:  # the one point where an extension's faster kernel takes a call
        out = kernel(q, k, v, attn_mask, is_causal, dropout_p, scale, backend, return_weights)
        if out is not None:
            return out
    B, n_head, T, d_k = q.shape
    n_kv_head, S, d_v = k.size(1), k.size(2), v.size(-1)
    n_rep = n_head // n_kv_head  # query heads per K/V head
    fused = backend == "sdpa" and not return_weights
    # SDPA's own is_causal is top-left aligned, so it serves only where that is the same thing.
    if fused and is_causal and attn_mask is None and T == S:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scale,
                                              enable_gqa=n_rep > 1)
    mask = attn_mask
    if is_causal and T > 1:  # (a single query, the last, sees every key)
        causal = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)  # (T, S)
        if mask is None or mask.dtype == torch.bool:
            mask = causal if mask is None else mask & causal
        else:  # a float mask: -inf where the band hides
            mask = mask.masked_fill(~causal, float("-inf"))
    if fused and n_rep == 1:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)
    if fused:
        # GQA, MQA: the n_rep query heads of a K/V head become n_rep x T queries of it, an MHA-shaped
        # call every fused kernel takes with a mask (SDPA's enable_gqa with a mask falls back to its
        # math kernel, which copies K and V per query head).
        q = q.reshape(B, n_kv_head, n_rep * T, d_k)                      # (B, n_kv_head, n_rep*T, d_k)
        if mask is not None:
            mask = fold_heads(mask, n_kv_head, n_rep, T, S)              # (B or 1, ., n_rep*T, S)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)
        return out.reshape(B, n_head, T, d_v)                            # (B, n_head, T, d_v)
    if backend not in ("sdpa", "naive"):
        raise ValueError(f"attend: unknown backend {backend!r} (sdpa or naive)")
    # The formula. Broadcasting over the n_rep query heads of a group reads their K/V head once.
    qg = q.view(B, n_kv_head, n_rep, T, d_k)                             # (B, n_kv_head, n_rep, T, d_k)
    scale = 1 / math.sqrt(d_k) if scale is None else scale
    scores = qg @ k.unsqueeze(2).transpose(-2, -1) * scale              # (B, n_kv_head, n_rep, T, S)
    scores = scores.view(B, n_head, T, S)                                # (B, n_head, T, S)
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        scores = scores + mask
    weights = F.softmax(scores, dim=-1)
    dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    out = dropped.view(B, n_kv_head, n_rep, T, S) @ v.unsqueeze(2)     # (B, n_kv_head, n_rep, T, d_v)
    out = out.view(B, n_head, T, d_v)                                    # (B, n_head, T, d_v)
    return (out, weights) if return_weights else out


def fold_heads(mask: torch.Tensor, n_kv_head: int, n_rep: int, T: int, S: int) -> torch.Tensor:
    """A mask for scores (B, n_kv_head * n_rep, T, S) as one for the same scores with the query
    heads folded, (B, n_kv_head, n_rep * T, S): query head h = kv * n_rep + r becomes query r * T + t
    of K/V head kv. `mask` broadcasts to the first: (T, S), (B, 1, T, S) or (B, n_head, T, S)."""
    mask = mask.reshape((1,) * (4 - mask.dim()) + mask.shape)           # (B or 1, 1 or n_head, ., S)
    if mask.size(1) == 1:  # the same for every head: repeated for the n_rep queries of each K/V head
        return mask.unsqueeze(2).expand(-1, 1, n_rep, T, S).reshape(-1, 1, n_rep * T, S)
    return mask.expand(-1, -1, T, S).reshape(-1, n_kv_head, n_rep * T, S)


def rope_frequencies(dim: int, base: float, device=None) -> torch.Tensor:
    """RoPE's dim/2 frequencies, base^(-2i/dim), in float32: pair i turns by position x frequency i."""
    return 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim)


def rope_angles(positions: torch.Tensor, frequencies: torch.Tensor):
    """cos and sin of RoPE's angles at `positions` (any shape P), each (*P, dim) in float32, laid out
    for `apply_rope`: cos over both halves, sin negated over the first."""
    angles = positions.float()[..., None] * frequencies                 # (*P, dim/2)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)  # (*P, dim) each


def apply_rope(x, cos, sin):
    """Rotate x (B, H, T, d) by its positions' angles, pairing x[..., :d/2] (x1) with x[..., d/2:] (x2):
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), computed as x cos + (x2, x1) sin in x's precision
    (bf16 under autocast, as nanochat and transformers' Llama rotate). cos and sin: rope_angles'."""
    if cos.dtype != x.dtype:
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([x2, x1], dim=-1) * sin


class CausalSelfAttention(nn.Module):
    """Multi-head attention with n_kv_head key/value heads: MHA (n_kv_head = n_head), GQA (fewer)
    and MQA (one) are this class. With a KV cache, the new keys and values go into it and the
    queries attend over every position it holds."""

    def __init__(self, config, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx  # its keys and values in the cache
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.backend, self.dropout = config.attn_backend, config.dropout
        heads = config.n_head + 2 * config.n_kv_head
        self.qkv = nn.Linear(config.n_embd, heads * config.head_dim, bias=config.bias)  # [q, k, v] heads
        self.proj = nn.Linear(config.n_head * config.head_dim, config.n_embd, bias=config.bias)

    def forward(self, x, rope=None, kv_cache=None):
        """x (B, T, n_embd) -> (B, T, n_embd). rope: (cos, sin) of the T positions, or None."""
        q, k, v = self.heads(x, rope)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, k, v)                 # (B, n_kv_head, S, hd) each
        return self.project(self.attend(q, k, v))

    def heads(self, x, rope=None):
        """x (B, T, n_embd) -> q (B, n_head, T, hd), k and v (B, n_kv_head, T, hd), q and k rotated."""
        B, T, _ = x.shape
        heads = self.qkv(x).view(B, T, self.n_head + 2 * self.n_kv_head, self.head_dim)  # (B, T, heads, hd)
        q, k, v = heads.transpose(1, 2).split_with_sizes(
            [self.n_head, self.n_kv_head, self.n_kv_head], dim=1)        # (B, heads, T, hd)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return q, k, v

    def attend(self, q, k, v, attn_mask=None, scale=None):
        """`attend` with this layer's backend and its dropout (training): causal, or as the mask says."""
        return attend(q, k, v, attn_mask, is_causal=attn_mask is None, scale=scale, backend=self.backend,
                      dropout_p=self.dropout if self.training else 0.0)

    def project(self, out):
        """The heads' outputs (B, n_head, T, d) side by side, (B, T, n_head * d), projected to n_embd."""
        B, _, T, _ = out.shape
        return self.proj(out.transpose(1, 2).reshape(B, T, -1))          # (B, T, n_embd)
