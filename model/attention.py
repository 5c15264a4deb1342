"""The attention layer of every variant, built on the core layer (model/core/attention.py). A
`kv_share` group's later layers attend over its first layer's keys and values, a layer may see a
sliding window (and sinks, both kinds), queries and keys may be normalised per head (qk-norm), a
cache hands keys in groups, rings, int8 or int4 (a chunk's in two precisions), and the inspect page
may keep the weights. Every layer attends through the core `attend`, to which this file adds the
extensions' kernels."""

import torch
import torch.nn as nn

from model.core.attention import KERNELS, apply_rope, attend
from model.core.attention import CausalSelfAttention as CoreAttention
from model.core.gpt import make_norm
from model.kernels import int8_step, split_kv_step
from model.kv_cache import MixedKeys, Quantized
from model.windows import WithSink, layer_mask, sink_as_key, without_sink


def int4_chunk(q, k, v, attn_mask, is_causal, dropout_p, scale, backend, return_weights):
    """attend's kernel for an int4 cache's chunk of queries, whose K and V come `MixedKeys`: the old
    cells dequantized and the recent positions as given side by side, each query's keys chosen by
    the distance rule (MixedKeys.visible) within the causal rule and `attn_mask` (bool, over the
    cells), then `attend`; the weights, if kept, per cell. None for any other call."""
    if not isinstance(k, MixedKeys):
        return None
    mask, sink_logit = without_sink(attn_mask)
    mask = k.visible(q.size(2), mask)                                    # (., T, d + cells - start)
    keys = torch.cat([k.old, k.recent], dim=2)                           # (B, heads, d + cells - start, dim)
    values = keys if v is k else torch.cat([v.old, v.recent], dim=2)     # (MLA: its keys)
    out = attend(q, keys, values, mask if sink_logit is None else WithSink(mask, sink_logit), is_causal=False,
                 dropout_p=dropout_p, scale=scale, backend=backend, return_weights=return_weights)
    return (out[0], k.per_cell(out[1])) if return_weights else out


KERNELS.extend([int8_step, int4_chunk, split_kv_step, sink_as_key])  # the first that takes a call computes it


class CausalSelfAttention(CoreAttention):
    """The core's MHA/GQA/MQA layer with the variants' fields: its place in a `kv_share` group (the
    first layer makes and caches K/V), its window and sinks, qk-norm, Qwen2's q/k/v biases, and the
    weights kept for heatmaps."""

    def __init__(self, config, layer_idx: int = 0):
        nn.Module.__init__(self)  # the core's modules, sized for the variant (built once, not twice)
        self.set_variant(config, layer_idx)
        self.n_kv_head = config.n_kv_head
        self.kv_dim = config.n_kv_head * config.head_dim if self.makes_kv else 0
        q_dim = config.n_head * config.head_dim
        qkv_bias = config.bias if config.qkv_bias is None else config.qkv_bias
        self.qkv = nn.Linear(config.n_embd, q_dim + 2 * self.kv_dim, bias=qkv_bias)  # [q, k, v]
        self.proj = nn.Linear(q_dim, config.n_embd, bias=config.bias)
        self.q_norm = make_norm(config, config.head_dim) if config.qk_norm else None
        self.k_norm = make_norm(config, config.head_dim) if config.qk_norm and self.makes_kv else None

    def set_variant(self, config, layer_idx: int) -> None:
        """What every variant's layer has (MLA's too): its kv_share group, backend, dropout, window,
        sinks, sink logit, and the weights kept for the inspect page."""
        self.layer_idx, self.n_head, self.head_dim = layer_idx, config.n_head, config.head_dim
        self.makes_kv = layer_idx % config.kv_share == 0
        self.kv_group = layer_idx // config.kv_share  # its group's cache: KVCache.groups[kv_group]
        self.backend, self.dropout = config.attn_backend, config.dropout
        self.window = config.layer_window(layer_idx)  # None: this layer sees the whole context
        self.attn_sinks = config.attn_sinks if self.window is not None else 0  # positions it always sees
        # gpt-oss's sink: a learned logit per head that joins the softmax (attention may go nowhere).
        self.sink_logit = nn.Parameter(torch.zeros(config.n_head)) if config.attn_sink_logit else None
        self.plain = self.window is None and self.sink_logit is None  # causal, or as a mask says
        self.keep_weights = False  # set True to keep the last attention weights in .weights
        self.weights = None

    def forward(self, x, rope=None, kv_cache=None, input_pos=None, attn_mask=None, shared_kv=None,
                cells_read=None, starts=None):
        """x (B, T, n_embd) -> (out (B, T, n_embd), the (k, v) attended over). With `kv_cache`, the new
        K/V go to positions `input_pos` (T,) and the queries attend over the cells the cache reads
        (`cells_read`; GroupCache.key_positions; `starts` (B,) places each row's sinks). `attn_mask` says
        which keys each query sees; without one, causal (within the window). A layer that makes no
        K/V attends over `shared_kv`."""
        q, k, v = self.heads(x, rope)
        if not self.makes_kv:
            k, v = shared_kv
        elif kv_cache is not None:
            k, v = kv_cache.groups[self.kv_group].update(input_pos, k, v, cells_read, starts)
        return self.project(self.attend(q, k, v, attn_mask)), (k, v)

    def heads(self, x, rope=None):
        """The core's heads, k and v empty in a layer that makes none, q and k normalised (qk-norm):
        q and k stay one tensor until RoPE has rotated both in one go. (split_with_sizes: split's list
        form without its Python wrapper.)"""
        B, T, _ = x.shape
        n_k = self.n_kv_head if self.makes_kv else 0                    # key (and value) heads made here
        heads = self.qkv(x).view(B, T, self.n_head + 2 * n_k, self.head_dim)   # (B, T, [q, k, v] heads, hd)
        qk, v = heads.transpose(1, 2).split_with_sizes([self.n_head + n_k, n_k], dim=1)  # (B, heads, T, hd)
        if self.q_norm is not None:
            q, k = qk.split_with_sizes([self.n_head, n_k], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k) if n_k else k], dim=1)
        if rope is not None:
            qk = apply_rope(qk, *rope)
        q, k = qk.split_with_sizes([self.n_head, n_k], dim=1)            # (B, n_head, T, hd), (B, n_k, T, hd)
        return q, k, v

    def attend(self, q, k, v, attn_mask=None, scale=None):
        """The core `attend` with this layer's backend and dropout, causal within its window (and its
        sinks) unless given a mask, which then says it all; its sink logit in every softmax; the weights
        kept (the formula, which returns them) when asked. An int8 cache's one-token step hands K and V
        `Quantized`: its kernel reads them so (model/kernels.py), but to keep the weights, as floats."""
        if self.keep_weights and isinstance(k, Quantized):
            k, v = (x.values.to(q.dtype) * x.scales.to(q.dtype) for x in (k, v))
        is_causal = attn_mask is None
        if not self.plain:
            S = k.cells if isinstance(k, MixedKeys) else (k.values if isinstance(k, Quantized) else k).size(2)
            attn_mask, is_causal = layer_mask(q.size(2), S, q.device, is_causal, attn_mask, self.window,
                                              self.attn_sinks, self.sink_logit)
        out = attend(q, k, v, attn_mask, is_causal=is_causal, scale=scale, backend=self.backend,
                     dropout_p=self.dropout if self.training else 0.0, return_weights=self.keep_weights)
        if self.keep_weights:
            out, self.weights = out
        return out
