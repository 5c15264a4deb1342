"""The one attention core.

`attend` computes softmax(q k^T / sqrt(hd)) v for n_head query heads over n_kv_head key/value
heads. MHA (n_kv_head == n_head), GQA (1 < n_kv_head < n_head) and MQA (n_kv_head == 1) are
the same code: query head h reads key/value head h // (n_head // n_kv_head).
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.config import GPTConfig


def causal_mask(T: int, S: int, device=None) -> torch.Tensor:
    """(T, S) bool, True where query i (the i-th of the *last* T positions) may see key j."""
    return torch.ones(T, S, dtype=torch.bool, device=device).tril(diagonal=S - T)


def attend(q, k, v, *, is_causal=True, attn_mask=None, dropout_p=0.0, backend="sdpa",
           return_weights=False):
    """q: (B, n_head, T, hd); k, v: (B, n_kv_head, S, hd) with S >= T.

    The T queries are the last T of the S positions, so the causal mask is bottom-right aligned:
    query i sees keys 0 .. S-T+i. `attn_mask` (bool, True = may attend, broadcastable to
    (B, n_head, T, S)) is combined with it. Returns (B, n_head, T, hd), and with
    `return_weights=True` (naive backend) also the weights (B, n_head, T, S).
    """
    B, n_head, T, hd = q.shape
    n_kv_head, S = k.shape[1], k.shape[2]
    if S < T or n_head % n_kv_head:
        raise ValueError(f"attend: need S >= T and n_head % n_kv_head == 0, got "
                         f"T={T}, S={S}, n_head={n_head}, n_kv_head={n_kv_head}")
    if return_weights and backend != "naive":
        raise ValueError("attend: return_weights=True needs backend='naive'")

    if backend == "sdpa":
        # SDPA's own is_causal is top-left aligned, so use it only where that is the same thing.
        if is_causal and attn_mask is None and T == S:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                                  enable_gqa=n_kv_head != n_head)
        mask = attn_mask
        if is_causal and T > 1:  # a single query is the last position: it sees every key
            mask = causal_mask(T, S, q.device) if mask is None else mask & causal_mask(T, S, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                              enable_gqa=n_kv_head != n_head)
    if backend != "naive":
        raise ValueError(f"attend: unknown backend {backend!r} (sdpa or naive)")

    # Group the query heads that share a key/value head; broadcasting reads each K/V head
    # once for its whole group instead of materialising n_head copies.
    n_rep = n_head // n_kv_head
    qg = q.view(B, n_kv_head, n_rep, T, hd)                            # (B, n_kv_head, n_rep, T, hd)
    scores = qg @ k.unsqueeze(2).transpose(-2, -1) / math.sqrt(hd)    # (B, n_kv_head, n_rep, T, S)
    scores = scores.view(B, n_head, T, S)                              # (B, n_head, T, S)
    if is_causal:
        scores = scores.masked_fill(~causal_mask(T, S, q.device), float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    weights = F.softmax(scores, dim=-1)
    dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    out = dropped.view(B, n_kv_head, n_rep, T, S) @ v.unsqueeze(2)   # (B, n_kv_head, n_rep, T, hd)
    out = out.view(B, n_head, T, hd)                                   # (B, n_head, T, hd)
    return (out, weights) if return_weights else out


def rope_cache(block_size: int, head_dim: int, base: float = 10000.0):
    """cos and sin tables, each (block_size, head_dim // 2), in float32."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(block_size, dtype=torch.float32), inv_freq)
    return angles.cos(), angles.sin()


def apply_rope(x, cos, sin):
    """Rotate pairs (x[..., :hd/2], x[..., hd/2:]) of x (B, H, T, hd) by the angles of their
    positions; cos and sin are (T, hd/2) or (B, 1, T, hd/2)."""
    x1, x2 = x.float().chunk(2, dim=-1)                                # (B, H, T, hd/2) each
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


def make_norm(config: GPTConfig, dim: int) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(dim, eps=config.norm_eps)
    return nn.LayerNorm(dim, eps=config.norm_eps, bias=config.bias)


class CausalSelfAttention(nn.Module):
    """Multi-head attention with n_kv_head key/value heads: MHA, GQA and MQA are this class."""

    def __init__(self, config: GPTConfig, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx  # which slot of a KVCache this layer writes
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.n_kv_head, config.head_dim
        self.backend = config.attn_backend
        self.dropout = config.dropout
        kv_dim = config.n_kv_head * config.head_dim
        # One fused projection: n_embd queries, then kv_dim keys, then kv_dim values.
        self.qkv = nn.Linear(config.n_embd, config.n_embd + 2 * kv_dim, bias=config.bias)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.q_norm = make_norm(config, config.head_dim) if config.qk_norm else None
        self.k_norm = make_norm(config, config.head_dim) if config.qk_norm else None
        self.keep_weights = False  # set True to keep the last attention weights in .weights
        self.weights = None

    def forward(self, x, *, rope=None, kv_cache=None, input_pos=None, attn_mask=None):
        """x: (B, T, n_embd). Without a mask, plain causal attention over x. With `kv_cache`,
        the new keys/values are written at slots `input_pos` (T,) and the queries attend over
        the whole cache under `attn_mask` (the GPT builds it; it encodes causality)."""
        B, T, C = x.shape
        kv_dim = self.n_kv_head * self.head_dim
        q, k, v = self.qkv(x).split([C, kv_dim, kv_dim], dim=-1)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)     # (B, n_head, T, hd)
        k = k.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, n_kv_head, T, hd)
        v = v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)  # (B, n_kv_head, T, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if kv_cache is not None:
            k, v = kv_cache.update(self.layer_idx, input_pos, k, v)    # (B, n_kv_head, max_len, hd)
        dropout_p = self.dropout if self.training else 0.0
        if self.keep_weights:  # for attention heatmaps: the textbook path, weights kept
            out, self.weights = attend(q, k, v, is_causal=attn_mask is None, attn_mask=attn_mask,
                                       dropout_p=dropout_p, backend="naive", return_weights=True)
        else:
            out = attend(q, k, v, is_causal=attn_mask is None, attn_mask=attn_mask,
                         dropout_p=dropout_p, backend=self.backend)
        out = out.transpose(1, 2).contiguous().view(B, T, C)            # (B, T, n_embd)
        return self.proj(out)
