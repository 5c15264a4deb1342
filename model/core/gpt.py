"""The GPT: token (and learned position) embeddings, a stack of pre-norm transformer blocks built on
the attention layer, and the output layer; with a KV cache, new tokens continue the cached ones."""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import CausalSelfAttention, rope_angles, rope_frequencies
from .kv_cache import KVCache


def make_norm(config, dim: int) -> nn.Module:
    """LayerNorm (GPT-2) or RMSNorm (Llama): RMSNorm only rescales, LayerNorm also centres."""
    if config.norm == "rmsnorm":
        return nn.RMSNorm(dim, eps=config.norm_eps)
    return nn.LayerNorm(dim, eps=config.norm_eps, bias=config.bias)


class MLP(nn.Module):
    """n_embd -> mlp_width -> n_embd through GELU (GPT-2), or SwiGLU (Llama): silu(gate) x up."""

    def __init__(self, config):
        super().__init__()
        self.swiglu, self.exact_gelu = config.mlp == "swiglu", config.mlp == "gelu_exact"
        hidden = config.mlp_width
        self.fc = nn.Linear(config.n_embd, hidden * (2 if self.swiglu else 1), bias=config.bias)  # [gate, up]
        self.proj = nn.Linear(hidden, config.n_embd, bias=config.bias)

    def forward(self, x):
        if self.swiglu:
            gate, up = self.fc(x).chunk(2, dim=-1)                       # (B, T, hidden) each
            return self.proj(F.silu(gate) * up)
        # GPT-2's GELU is tanh-approximated; the exact one (erf) is cheaper on a CPU.
        return self.proj(F.gelu(self.fc(x), approximate="none" if self.exact_gelu else "tanh"))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    attention = CausalSelfAttention  # the attention layer it builds (config, layer_idx)

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.norm_1 = make_norm(config, config.n_embd)
        self.attn = self.attention(config, layer_idx)
        self.norm_2 = make_norm(config, config.n_embd)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.dropout) if config.dropout else nn.Identity()

    def forward(self, x, rope=None, kv_cache=None):
        x = x + self.dropout(self.attn(self.norm_1(x), rope, kv_cache))
        return x + self.dropout(self.mlp(self.norm_2(x)))


class GPT(nn.Module):
    """A decoder-only transformer: idx (B, T) token ids -> logits (B, T, vocab_size) of the next."""

    block = Block  # the block it stacks (config, layer_idx)

    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd) if config.pos_emb == "learned" else None
        self.drop = nn.Dropout(config.dropout) if config.dropout else nn.Identity()
        self.blocks = nn.ModuleList(self.block(config, i) for i in range(config.n_layer))
        self.norm_f = make_norm(config, config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        # GPT-2 init: N(0, 0.02), residual projections scaled by 1/sqrt(2·n_layer) so the
        # residual stream's variance does not grow with depth.
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def forward(self, idx, targets=None, *, kv_cache=None):
        """idx: (B, T) token ids. Returns logits (B, T, vocab_size), or (logits, loss) with targets.
        With `kv_cache`, the tokens continue the cached ones: positions kv_cache.length .. +T-1."""
        T = idx.size(1)
        start = 0 if kv_cache is None else kv_cache.length
        if start + T > self.config.block_size:
            raise ValueError(f"{start + T} positions exceed block_size={self.config.block_size}")
        positions = torch.arange(start, start + T, device=idx.device)  # (T,)
        x = self.wte(idx)                                                # (B, T, n_embd)
        rope = None
        if self.wpe is not None:
            x = x + self.wpe(positions)
        else:
            frequencies = rope_frequencies(self.config.rope_dim, self.config.rope_base, idx.device)
            rope = rope_angles(positions, frequencies)                   # (cos, sin), (T, hd) each
        x = self.drop(x)
        for block in self.blocks:
            x = block(x, rope, kv_cache)
        if kv_cache is not None:
            kv_cache.advance(T)
        logits = self.lm_head(self.norm_f(x))                            # (B, T, vocab_size)
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-1)
        return logits, loss

    def new_kv_cache(self, batch_size: int, max_len: int | None = None, dtype=None) -> KVCache:
        """An empty cache for `batch_size` rows of up to max_len (default block_size) positions, on the
        model's device, in its dtype (or `dtype`)."""
        c, weight = self.config, self.wte.weight
        return KVCache(c.n_layer, batch_size, c.n_kv_head, max_len or c.block_size, c.head_dim,
                       dtype=dtype or weight.dtype, device=weight.device)

    def num_params(self) -> int:
        """Parameters, each counted once (a tied output layer shares the embedding's)."""
        return sum(p.numel() for p in self.parameters())
