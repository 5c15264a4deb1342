"""Multi-head latent attention (MLA, DeepSeek-V2), built on the variants' layer (model/attention.py).
Keys and values come from one narrow latent per position, which is all the cache keeps, attended
over in its absorbed form."""

import math

import torch
import torch.nn as nn

from model.attention import CausalSelfAttention
from model.core.attention import apply_rope
from model.core.gpt import make_norm


class LatentAttention(CausalSelfAttention):
    """Multi-head latent attention (MLA; DeepSeek-V2, 2024, section 2.1; README, "Attention variants").

    Per position, a normalised latent c (width L) and a RoPE key k_r (width R) shared by all heads;
    head h's key is [W_k[h] c, k_r] and its value W_v[h] c, W_k[h] and W_v[h] of shape (hd, L). Without a
    cache, the plain form expands them per head (MHA with d_k = hd + R, d_v = hd). With one, the absorbed
    form attends with W_k[h]^T q_h over the cached [c, k_r] (one K/V head) and applies W_v[h] after:
    since q_h . W_k[h] c = (W_k[h]^T q_h) . c, both forms compute the same function.
    """

    def __init__(self, config, layer_idx: int = 0):
        nn.Module.__init__(self)  # no qkv: its own projections
        self.set_variant(config, layer_idx)
        self.latent_dim, self.rope_dim = config.mla_latent_dim, config.mla_rope_dim
        hd, L, R = self.head_dim, self.latent_dim, self.rope_dim
        self.q = nn.Linear(config.n_embd, config.n_head * (hd + R), bias=config.bias)  # per head: [q, q_r]
        if self.makes_kv:
            self.kv_down = nn.Linear(config.n_embd, L + R, bias=config.bias)  # [c before its norm, k_r]
            # (mla_kv_norm false: a retrofit's latent, a linear factorisation of the old K/V, used as made)
            self.kv_norm = make_norm(config, L) if config.mla_kv_norm else nn.Identity()
        # Per head, the key then the value up-projection. A Parameter, not a Linear: the absorbed form
        # multiplies by it per head (and int8 decoding, which converts Linears, leaves it alone).
        self.kv_up = nn.Parameter(torch.randn(2 * config.n_head * hd, L) * 0.02)  # (2 * n_head * hd, L)
        self.proj = nn.Linear(config.n_head * hd, config.n_embd, bias=config.bias)

    def forward(self, x, rope=None, kv_cache=None, input_pos=None, attn_mask=None, shared_kv=None,
                cells_read=None, starts=None):
        """As CausalSelfAttention.forward, but what is attended over, returned and cached is [c, k_r]:
        (B, 1, T or max_len, L + R)."""
        B, T, _ = x.shape
        hd, L, R = self.head_dim, self.latent_dim, self.rope_dim
        q = self.q(x).view(B, T, self.n_head, hd + R).transpose(1, 2)   # (B, n_head, T, hd + R)
        q, q_rope = q.split_with_sizes([hd, R], dim=-1)                   # (B, n_head, T, hd), (.., R)
        if rope is not None:
            q_rope = apply_rope(q_rope, *rope)
        if self.makes_kv:
            down = self.kv_down(x).unsqueeze(1)                           # (B, 1, T, L + R)
            c_raw, k_rope = down.split_with_sizes([L, R], dim=-1)         # (B, 1, T, L), (.., R)
            if rope is not None:
                k_rope = apply_rope(k_rope, *rope)
            latent = torch.cat([self.kv_norm(c_raw), k_rope], dim=-1)     # (B, 1, T, L + R)
            if kv_cache is not None:
                latent, _ = kv_cache.groups[self.kv_group].update(input_pos, latent, None, cells_read, starts)
        else:
            latent = shared_kv
        w_k, w_v = self.kv_up.view(2, self.n_head, hd, L).unbind(0)       # (n_head, hd, L) each
        scale = 1 / math.sqrt(hd + R)
        if kv_cache is None:  # plain form
            c, k_rope = latent.split_with_sizes([L, R], dim=-1)           # (B, 1, S, L), (B, 1, S, R)
            S = latent.size(2)
            k = torch.cat([c @ w_k.transpose(1, 2),                       # (B, n_head, S, hd)
                           k_rope.expand(B, self.n_head, S, R)], dim=-1)  # (B, n_head, S, hd + R)
            v = c @ w_v.transpose(1, 2)                                   # (B, n_head, S, hd)
            out = self.attend(torch.cat([q, q_rope], dim=-1), k, v, attn_mask, scale)  # (B, n_head, T, hd)
        else:  # absorbed form
            # Per head h, q_h W_k[h] and later o_h W_v[h]^T, as one product batched over the heads
            # (einsum: `q @ w_k` would broadcast w_k over the batch by copying it per row first).
            q_latent = torch.einsum("bhtd,hdl->bhtl", q, w_k)             # (B, n_head, T, L)
            # The values are c, the first L columns of each cached [c, k_r]. The whole row as value,
            # keeping L output columns, gives the same numbers with d_v = d_k, which SDPA's fused
            # kernels need (its math path is ~10x slower on CPU at batch 64 and context 1024).
            out = self.attend(torch.cat([q_latent, q_rope], dim=-1), latent, latent, attn_mask,
                              scale)[..., :L]                             # (B, n_head, T, L)
            out = torch.einsum("bhtl,hdl->bhtd", out, w_v)                # (B, n_head, T, hd)
        return self.project(out), latent
