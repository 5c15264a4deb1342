"""Attention: `attend`, the one core, and the layers built on it. It takes n_head query heads over
n_kv_head key/value heads (query head h reads K/V head h // (n_head // n_kv_head)), values of any
width (MLA's are narrower than its keys). `CausalSelfAttention` (MHA, GQA, MQA) and `LatentAttention`
(MLA) return what they attended over: a `GPTConfig.kv_share` group's later layers attend over it.
"""

import functools
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from model.config import GPTConfig
from model.kv_cache import Quantized


def visible(query_pos, key_pos, window=None, attn_sinks=0, pad=None) -> torch.Tensor:
    """Which keys a query may attend to: the one rule every mask comes from (training, a prompt's
    prefill, its chunks, the one-token step over any cache). True where the query at query_pos (T,)
    may see the key at key_pos (S,) or (B, S): a written position (-1: a cell that holds none to
    see) at or before it, within `window` of it or one of the row's first `attn_sinks` positions
    (StreamingLLM's sinks), and not a row's left padding (pad (B,): its position 0 comes after
    them) unless the query is one too, so that no row is empty (NaN). (T, S), or with pad (B, 1, T, S)."""
    key_pos = key_pos[..., None, :]                                  # (1, S) or (B, 1, S)
    distance = query_pos[:, None] - key_pos                          # (T, S) or (B, T, S)
    mask = (distance >= 0) & (key_pos >= 0)
    row_start = 0 if pad is None else pad[:, None, None]             # (B, 1, 1): each row's position 0
    if window is not None:
        mask = mask & ((distance < window) | (key_pos - row_start < attn_sinks))
    if pad is None:
        return mask
    is_pad_key = key_pos < row_start                                 # (B, 1, S)
    is_pad_query = query_pos[:, None] < row_start                    # (B, T, 1)
    return (mask & (~is_pad_key | is_pad_query)).unsqueeze(1)        # (B, 1, T, S)


def causal_mask(T: int, S: int, device=None, window: int | None = None, attn_sinks: int = 0) -> torch.Tensor:
    """`visible` for queries at the last T of positions 0 .. S-1 over all S: (T, S), bottom-right."""
    return visible(torch.arange(S - T, S, device=device), torch.arange(S, device=device), window, attn_sinks)


def fold_mask(mask: torch.Tensor, n_kv_head: int, n_rep: int, T: int, S: int) -> torch.Tensor:
    """A mask for scores (B, n_kv_head * n_rep, T, S) as one for the same scores with the query
    heads folded, (B, n_kv_head, n_rep * T, S): query head h = kv * n_rep + r becomes query r * T + t
    of K/V head kv. `mask` broadcasts to the first: (T, S), (B, 1, T, S) or (B, n_head, T, S)."""
    mask = mask.reshape((1,) * (4 - mask.dim()) + mask.shape)               # (B or 1, 1 or n_head, ., S)
    if mask.size(1) == 1:  # the same for every head: repeated for the n_rep queries of each K/V head
        return mask.unsqueeze(2).expand(-1, 1, n_rep, T, S).reshape(-1, 1, n_rep * T, S)
    return mask.expand(-1, -1, T, S).reshape(-1, n_kv_head, n_rep * T, S)


def attend(q, k, v, *, is_causal=True, window=None, attn_sinks=0, sink_logit=None, attn_mask=None,
           dropout_p=0.0, backend="sdpa", return_weights=False, scale=None):
    """q (B, n_head, T, d_k), k (B, n_kv_head, S, d_k), v (B, n_kv_head, S, d_v) -> (B, n_head, T, d_v).

    The queries are the last T of S positions, so the causal mask is bottom-right aligned (query i
    sees keys 0 .. S-T+i); with `window` (sliding-window attention), only the last `window` of those
    and the first `attn_sinks`. `attn_mask` (bool, True = may attend) is and-ed with it; `scale` defaults
    to 1/sqrt(d_k). `sink_logit` (n_head,) is gpt-oss's learned sink: one more logit per head in
    every softmax, whose value is zero. `return_weights` (naive backend) also returns the weights
    (B, n_head, T, S). Checked here; the layers call attend_sdpa or attend_naive (no check a token).
    """
    check_attend_args(q, k, v, backend, return_weights)
    if backend == "sdpa":
        return attend_sdpa(q, k, v, is_causal, window, attn_sinks, sink_logit, attn_mask, dropout_p, scale)
    return attend_naive(q, k, v, is_causal, window, attn_sinks, sink_logit, attn_mask, dropout_p,
                        return_weights, scale)


def attend_sdpa(q, k, v, is_causal, window, attn_sinks, sink_logit, attn_mask, dropout_p, scale):
    """`attend` through PyTorch's fused kernels (scaled_dot_product_attention)."""
    B, n_head, T, d_k = q.shape
    n_kv_head, S, d_v = k.shape[1], k.shape[2], v.shape[-1]
    # SDPA's own is_causal is top-left aligned, so use it only where that is the same thing.
    if is_causal and attn_mask is None and T == S and window is None and sink_logit is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True,
                                              scale=scale, enable_gqa=n_kv_head != n_head)
    mask = attn_mask
    if is_causal and (T > 1 or window is not None):  # a single query, the last, sees every key
        causal = causal_mask(T, S, q.device, window, attn_sinks)
        mask = causal if mask is None else mask & causal
    if T == 1 and SplitKV.on and splits_kv(d_k, d_v, mask):
        return attend_split_kv(q, k, v, mask, sink_logit, scale)
    if sink_logit is not None:  # one more key, whose additive mask is the learned logit
        k, v, mask = with_sink_key(k, v, mask, sink_logit, (B, n_head, T, S), q.dtype)
        S += 1
    if n_kv_head == n_head:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)
    # GQA, MQA, absorbed MLA: the n_rep query heads of a K/V head become n_rep x T queries of it,
    # an MHA-shaped call that every fused kernel takes with a mask (none takes enable_gqa and a
    # mask in PyTorch 2.11: its math fallback copies K and V per query head).
    n_rep = n_head // n_kv_head
    q = q.reshape(B, n_kv_head, n_rep * T, d_k)                        # (B, n_kv_head, n_rep*T, d_k)
    if mask is not None:
        mask = fold_mask(mask, n_kv_head, n_rep, T, S)                # (B or 1, ., n_rep*T, S)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scale)
    return out.reshape(B, n_head, T, d_v)                            # (B, n_head, T, d_v)


def attend_naive(q, k, v, is_causal, window, attn_sinks, sink_logit, attn_mask, dropout_p, return_weights,
                 scale):
    """`attend` written out: the scores, the masks, the softmax (with the sink's logit), the values."""
    B, n_head, T, d_k = q.shape
    n_kv_head, S, d_v = k.shape[1], k.shape[2], v.shape[-1]
    # Broadcasting over the n_rep query heads of a group reads their K/V head once: no n_head copies.
    n_rep = n_head // n_kv_head
    qg = q.view(B, n_kv_head, n_rep, T, d_k)                           # (B, n_kv_head, n_rep, T, d_k)
    scale = 1 / math.sqrt(d_k) if scale is None else scale
    scores = qg @ k.unsqueeze(2).transpose(-2, -1) * scale            # (B, n_kv_head, n_rep, T, S)
    scores = scores.view(B, n_head, T, S)                              # (B, n_head, T, S)
    if is_causal:
        scores = scores.masked_fill(~causal_mask(T, S, q.device, window, attn_sinks), float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    if sink_logit is None:
        weights = F.softmax(scores, dim=-1)
    else:  # the sink's logit joins the softmax; its weight goes nowhere
        sink = sink_logit.to(scores.dtype).view(1, n_head, 1, 1).expand(B, n_head, T, 1)
        weights = F.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :S]  # (B, n_head, T, S)
    dropped = F.dropout(weights, p=dropout_p) if dropout_p > 0 else weights
    out = dropped.view(B, n_kv_head, n_rep, T, S) @ v.unsqueeze(2)   # (B, n_kv_head, n_rep, T, d_v)
    out = out.view(B, n_head, T, d_v)                                  # (B, n_head, T, d_v)
    return (out, weights) if return_weights else out


class SplitKV:
    """A context in which `attend` gives a one-query call (a decode step) to `attend_split_kv`:
    CompiledDecodeStep builds its CUDA step inside it. Off elsewhere: an eager step's key length grows
    every token, and each new length would compile a kernel of its own. Entered, it notes whether
    the GPU is a Hopper or newer (`hopper`: a constant where a step is traced)."""

    on, hopper = False, False

    def __enter__(self):
        self.was, SplitKV.on = SplitKV.on, True
        SplitKV.hopper = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)

    def __exit__(self, *exc):
        SplitKV.on = self.was


def attend_split_kv(q, k, v, mask=None, sink_logit=None, scale=None):
    """`attend` for one query per row by flash-decoding: FlexAttention's decoding kernel splits the
    S positions across thread blocks, each computes its part's softmax-weighted sum and its
    log-sum-exp, and a second pass combines them. (SDPA's kernels run one thread block per row and
    head: at batch 1, 12 blocks on a GPU of 132 multiprocessors, each reading the whole cache.)
    q (B, n_head, 1, d_k), k (B, n_kv_head, S, d_k), v (B, n_kv_head, S, d_v) -> (B, n_head, 1, d_v).
    The n_rep query heads of a K/V head are its n_rep queries (the kernel's fast path takes n_rep
    queries, not n_rep heads of a number other than a power of two); `mask` (bool, True = may
    attend) is one row per batch row, (S,) broadcasting to it; gpt-oss's `sink_logit` (n_head,)
    scales each head's output by the share the sink leaves: softmax over S keys and the sink is
    softmax over the keys times e^lse / (e^lse + e^sink) = sigmoid(lse - sink). Compiled: inside a
    compiled step, traced into its graph; called eagerly on CUDA, its own compiled kernel per shape
    (a CPU runs FlexAttention's unfused reference: the tests')."""
    B, n_head, _, d_k = q.shape
    n_kv_head, S = k.shape[1], k.shape[2]
    n_rep = n_head // n_kv_head
    q = q.reshape(B, n_kv_head, n_rep, d_k)                            # (B, n_kv_head, n_rep, d_k)
    score_mod = None
    if mask is not None:
        allowed = mask.reshape(-1, S).expand(B, S)                     # (B, S)
        score_mod = lambda score, b, h, q_idx, kv_idx: torch.where(allowed[b, kv_idx], score, -math.inf)  # noqa: E731
    if q.is_cuda and not torch.compiler.is_compiling():  # eager: its own compiled kernel, tuned per shape
        flex, options = compiled_flex_attention((q.shape, k.shape, v.shape, q.dtype, mask is None,
                                                 sink_logit is None)), None
    else:  # traced into a compiled step (where tuning fails to compile), or a CPU's unfused reference
        flex, options = flex_decode, None
        if q.is_cuda and SplitKV.hopper:
            options = decode_kernel_options(B * n_kv_head, max(d_k, v.size(-1)), q.element_size())
    if sink_logit is None:
        out = flex(q, k, v, score_mod, scale, kernel_options=options)  # (B, n_kv_head, n_rep, d_v)
    else:  # lse (B, n_kv_head, n_rep): each sum's log
        out, lse = flex(q, k, v, score_mod, scale, lse=True, kernel_options=options)
        kept = torch.sigmoid(lse - sink_logit.float().view(n_kv_head, n_rep))
        out = out * kept.unsqueeze(-1).to(out.dtype)
    return out.reshape(B, n_head, 1, v.size(-1))                       # (B, n_head, 1, d_v)


def splits_kv(d_k: int, d_v: int, mask=None) -> bool:
    """Whether attend_split_kv takes this call: heads of a power of two from 16 wide (FlexAttention's
    kernels take 16 or more, and pad a width to the next power of two: MLA's 288 to 512, with which
    the absorbed step ran 1.4-1.7x slower than SDPA's memory-efficient kernel on an H200), and a mask
    that is the same for every head, if any."""
    heads_fit = all(d >= 16 and d & (d - 1) == 0 for d in (d_k, d_v))
    return heads_fit and (mask is None or mask.dim() < 4 or mask.size(1) == 1)


def decode_kernel_options(rows: int, head_dim: int, itemsize: int) -> dict:
    """FlexAttention's decoding kernel configuration inside a compiled step on Hopper or newer
    (where timing its candidates fails to compile, PyTorch 2.11): from 16 `rows` (batch x K/V heads)
    tiles of up to 128 keys (16 KB of K and of V) in 3 stages, within 13% of the fastest where
    inductor's default ran up to 2.1x slower (H200: benchmarks/RESULTS.md); below, the default."""
    if rows < 16:
        return {}
    return {"num_stages": 3, "BLOCK_N": max(16, min(128, 16384 // (head_dim * itemsize)))}


def flex_decode(q, k, v, score_mod=None, scale=None, lse=False, kernel_options=None):
    """flex_attention over every key, in blocks of 128: its decoding kernel splits the keys by
    these blocks (with no block mask, all of them are one block, and one thread block reads it
    all). With lse, (out, the log-sum-exp of each query's scores). kernel_options: its
    configuration (decode_kernel_options), or None for inductor's."""
    from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention  # (the compiler's)

    S, block = k.size(2), 128
    n = -(-S // block)
    blocks = BlockMask.from_kv_blocks(
        torch.full((1, 1, 1), n, dtype=torch.int32, device=q.device),                   # (1, 1, 1)
        torch.arange(n, dtype=torch.int32, device=q.device).view(1, 1, 1, n),         # (1, 1, 1, n)
        BLOCK_SIZE=block, seq_lengths=(q.size(2), S), compute_q_blocks=False)
    if not lse:
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=blocks, scale=scale,
                              kernel_options=kernel_options)
    out, aux = flex_attention(q, k, v, score_mod=score_mod, block_mask=blocks, scale=scale,
                              kernel_options=kernel_options, return_aux=AuxRequest(lse=True))
    return out, aux.lse


@functools.cache
def compiled_flex_attention(shapes: tuple):
    """FlexAttention compiled for one call's shapes and options (`shapes`, the cache's key), for
    eager steps on CUDA (a captured CUDA graph replays its kernels): fixed sizes (the decoding kernel
    needs the batch and heads fixed), each in a code object of its own, so that dynamo's limit of 8
    graphs per code object never sends a ninth shape back to the unfused reference."""
    def flex(*args, **kwargs):
        return flex_decode(*args, **kwargs)

    flex.__code__ = flex.__code__.replace()
    # Inductor times the decoding kernel's configurations (keys a block, pipeline stages, warps) for
    # this shape and keeps the fastest (max-autotune; matrix products, none here, would stay cuBLAS's):
    # its default (64 keys a block, 1 stage, 2 warps) keeps little in flight. On an H200 at GPT-2
    # width and batch 256, MHA's step went from 42,228 to 68,804 tokens/s, MQA's from 141,686 to
    # 186,000. (Inside the compiled step's graph the same option failed to compile with PyTorch 2.11:
    # that graph keeps the default configuration.)
    return torch.compile(flex, dynamic=False, fullgraph=True,
                         options={"max_autotune": True, "max_autotune_gemm_backends": "ATEN"})


def attend_one_query(q, k: Quantized, v: Quantized, attn_mask=None, sink_logit=None, scale=None):
    """`attend` for one query per row over an int8 cache as stored: q (B, n_head, 1, d_k), k and v
    `Quantized` (int8 (B, n_kv_head, S, d), scales (B, n_kv_head, S, 1)), attn_mask (bool) broadcasting
    to (B, n_head, 1, S) -> (B, n_head, 1, d_v). The scales factor out of both sums, q . (s_j k_j) =
    s_j (q . k_j) and sum_j w_j (s_j v_j) = sum_j (w_j s_j) v_j, so no float K or V is made:
    compiled, the int8 numbers turn into floats inside the two reductions and the cache is read
    once, as int8 (a quarter of float32's bytes). Query head h reads K/V head h // n_rep."""
    B, n_head, _, d_k = q.shape
    n_kv_head, S, d_v = k.values.size(1), k.values.size(2), v.values.size(-1)
    n_rep = n_head // n_kv_head
    scale = 1 / math.sqrt(d_k) if scale is None else scale
    qg = q.float().view(B, n_kv_head, n_rep, 1, d_k)                   # (B, n_kv_head, n_rep, 1, d_k)
    scores = (qg * k.values.unsqueeze(2).float()).sum(-1)             # (B, n_kv_head, n_rep, S)
    scores = scores * k.scales[..., 0].unsqueeze(2).float() * scale
    if attn_mask is not None:
        mask = attn_mask.reshape((1,) * (4 - attn_mask.dim()) + attn_mask.shape)  # (B or 1, ., 1, S)
        scores = scores.masked_fill(~mask.expand(B, n_head, 1, S).reshape(B, n_kv_head, n_rep, S),
                                    float("-inf"))
    if sink_logit is not None:  # gpt-oss's sink joins the softmax; its weight goes nowhere
        sink = sink_logit.float().view(1, n_kv_head, n_rep, 1).expand(B, -1, -1, 1)
        weights = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :S]
    else:
        weights = torch.softmax(scores, dim=-1)                         # (B, n_kv_head, n_rep, S)
    weights = weights * v.scales[..., 0].unsqueeze(2).float()
    out = (weights.unsqueeze(-1) * v.values.unsqueeze(2).float()).sum(-2)  # (B, n_kv_head, n_rep, d_v)
    return out.view(B, n_head, 1, d_v).to(q.dtype)


@functools.cache
def compiled_attend_one_query():
    """Its own compiled kernel for an eager model's int8 steps (dynamic: the cells read grow each
    step; one graph for every layer and step of a sample); inside the compiled decode step it is
    traced into the step's graph instead. Past dynamo's limit of graphs per function it runs
    eagerly: the same numbers. Made on first use (torch.compile imports dynamo and inductor, ~2 s)."""
    return torch.compile(attend_one_query, dynamic=True)


# The compiled kernel saved ~2-9 ns per int8 number of K a step read, nothing below ~2^17 a step;
# compiling it took 18-37 s (~5 s from inductor's disk cache). docs/variants.md has the numbers.
COMPILE_FROM = 2**18  # int8 numbers a group's cache holds from which the compiled kernel is the faster
PAYS_FROM = 2**32  # int8 numbers of K a decode's steps read, all layers, that save a cold compile


def compiling_pays(cache, positions: int, steps: int, layers: int) -> bool:
    """Whether `steps` one-token steps after `positions` cached ones, by `layers` layers over
    `cache`'s groups (kv_share: several a group), read PAYS_FROM int8 numbers of K: each step reads
    its group's cells written so far (at most all of them: a refill or a ring keeps it there).
    SmolLM2-135M (30 layers, 3 K/V heads of 64) after a prompt of 1,000 reads 2^32 in ~580 steps."""
    a_step = sum(group.k.tensors[0][:, :, 0].numel() * min(group.cells, positions + steps / 2)
                 for group in cache.groups)  # (rows x heads x dim numbers a cell) x cells, on average
    return steps * a_step * layers / len(cache.groups) >= PAYS_FROM


def attend_quantized(q, k: Quantized, v: Quantized, attn_mask=None, sink_logit=None, scale=None):
    """attend_one_query, compiled or not as one_query_kernel says."""
    return one_query_kernel(q, k)(q, k, v, attn_mask, sink_logit, scale)


def one_query_kernel(q, k: Quantized):
    """attend_one_query as an int8 step runs it: traced into the caller's graph, or through its own
    compiled kernel. As written while a CUDA graph captures it, over a cache too small for the
    compiled kernel to be faster (COMPILE_FROM: the whole group cache, not the part read, so a cache
    keeps one kernel from its first step to its last), and for a decode too short to pay for
    compiling it (k.may_compile, which `stream` sets once per sample from compiling_pays)."""
    if torch.compiler.is_compiling():
        return attend_one_query
    group_numbers = k.values.untyped_storage().nbytes() // k.values.element_size()
    as_written = (not k.may_compile or group_numbers < COMPILE_FROM
                  or (q.is_cuda and torch.cuda.is_current_stream_capturing()))
    return attend_one_query if as_written else compiled_attend_one_query()


def check_attend_args(q, k, v, backend, return_weights) -> None:
    """attend's shapes (S >= T, n_kv_head dividing n_head, q and k of one width, v with k's heads and
    positions) and options, or a ValueError saying which."""
    (n_head, T, d_k), (n_kv_head, S) = q.shape[1:], k.shape[1:3]
    if S < T or n_head % n_kv_head or k.shape[-1] != d_k or v.shape[1:3] != k.shape[1:3]:
        raise ValueError(f"attend: need S >= T, n_head % n_kv_head == 0, q and k of one width and "
                         f"v with k's heads and positions; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)} (n_head={n_head}, n_kv_head={n_kv_head})")
    if backend not in ("sdpa", "naive"):
        raise ValueError(f"attend: unknown backend {backend!r} (sdpa or naive)")
    if return_weights and backend != "naive":
        raise ValueError("attend: return_weights=True needs backend='naive'")


def with_sink_key(k, v, mask, sink_logit, shape, dtype):
    """gpt-oss's learned sink as one more key per head for SDPA: a zero key (score 0) whose additive
    mask is the head's logit, and a zero value. Returns k and v with it (.., S + 1, .) and the float
    mask (B, n_head, T, S + 1): 0 where `mask` (bool, broadcasting to `shape`, or None) allows, -inf
    where not."""
    B, n_head, T, S = shape
    bias = torch.zeros(shape, dtype=dtype, device=k.device)                 # (B, n_head, T, S)
    if mask is not None:
        bias = bias.masked_fill(~mask, float("-inf"))
    sink = sink_logit.to(dtype).view(1, n_head, 1, 1).expand(B, n_head, T, 1)
    zero = k.new_zeros(B, k.size(1), 1, k.size(-1)), v.new_zeros(B, v.size(1), 1, v.size(-1))
    return (torch.cat([k, zero[0]], dim=2), torch.cat([v, zero[1]], dim=2),  # (B, n_kv_head, S + 1, .)
            torch.cat([bias, sink], dim=-1))                                # (B, n_head, T, S + 1)


def rope_angles(positions: torch.Tensor, head_dim: int, base: float = 10000.0, scaling: tuple | None = None):
    """cos and sin of RoPE's angles at `positions` (any shape P), each (*P, head_dim) in float32, laid
    out for `apply_rope`: cos over both halves, sin negated over the first. Computed per call, from
    the positions: no table, so no last position. The frequencies (rope_frequencies: `base`, Llama 3's
    `scaling`) are kept (a compiled step's graph computes them)."""
    frequencies = rope_frequencies if torch.compiler.is_compiling() else kept_rope_frequencies
    inv_freq = frequencies(head_dim, base, scaling, positions.device)   # (head_dim/2,)
    angles = positions.float()[..., None] * inv_freq                   # (*P, head_dim/2)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)  # (*P, head_dim) each


def rope_frequencies(head_dim: int, base: float, scaling: tuple | None = None, device=None) -> torch.Tensor:
    """RoPE's head_dim/2 frequencies, base^(-2i/head_dim), in float32. With Llama 3's `scaling`, the
    values of GPTConfig.rope_scaling in ROPE_SCALING_KEYS' order (factor, low, high, original): a
    wavelength longer than original / low (a pattern the model never saw whole in training) is
    stretched by `factor`, one shorter than original / high kept, and those between blended."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
    if scaling is None:
        return inv_freq
    factor, low, high, original = scaling
    wavelength = 2 * math.pi / inv_freq
    kept = ((original / wavelength - low) / (high - low)).clamp(0, 1)  # 0: stretched ... 1: kept
    return (1 - kept) * inv_freq / factor + kept * inv_freq


@functools.cache
def kept_rope_frequencies(head_dim: int, base: float, scaling: tuple | None = None,
                          device=None) -> torch.Tensor:
    """rope_frequencies, made once and kept: outside inference mode, an ordinary tensor whichever call
    made it first (an inference tensor cannot be saved for a backward pass)."""
    with torch.inference_mode(False):
        return rope_frequencies(head_dim, base, scaling, device)


def apply_rope(x, cos, sin):
    """Rotate x (B, H, T, d) by its positions' angles, pairing x[..., :d/2] (x1) with x[..., d/2:] (x2):
    (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin), computed as x cos + (x2, x1) sin in four
    operations, in x's precision (bf16 under autocast: half the memory traffic of a float32 round
    trip, as nanochat and transformers' Llama rotate). cos and sin are rope_angles', (T, d) or
    (B, 1, T, d)."""
    if cos.dtype != x.dtype:  # (bf16 under autocast; a call where they match costs a CPU decode ~15 µs)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([x2, x1], dim=-1) * sin  # (x2, x1): roll's result, in a faster kernel


def make_norm(config: GPTConfig, dim: int) -> nn.Module:
    if config.norm == "rmsnorm":
        return nn.RMSNorm(dim, eps=config.norm_eps)
    return nn.LayerNorm(dim, eps=config.norm_eps, bias=config.bias)


class Attention(nn.Module):
    """Shared by both layers: the place in a `kv_share` group (its first layer makes and caches K/V),
    the backend, dropout, and the weights kept for heatmaps."""

    def __init__(self, config: GPTConfig, layer_idx: int):
        super().__init__()
        self.makes_kv = layer_idx % config.kv_share == 0
        self.kv_group = layer_idx // config.kv_share  # its group's cache: KVCache.groups[kv_group]
        self.n_head, self.head_dim = config.n_head, config.head_dim
        self.backend, self.dropout = config.attn_backend, config.dropout
        self.window = config.layer_window(layer_idx)  # None: this layer sees the whole context
        self.attn_sinks = config.attn_sinks if self.window is not None else 0  # positions it always sees
        # gpt-oss's sink: a learned logit per head that joins the softmax (attention may go nowhere).
        self.sink_logit = nn.Parameter(torch.zeros(config.n_head)) if config.attn_sink_logit else None
        self.keep_weights = False  # set True to keep the last attention weights in .weights
        self.weights = None

    def attend(self, q, k, v, attn_mask, scale=None):
        """`attend` with this layer's backend and dropout, causal (within the window) unless given a
        mask, which then says it all; naive (which can return them) when keeping the weights."""
        causal = attn_mask is None
        if isinstance(k, Quantized):  # an int8 cache's one-token step: read as stored
            if not self.keep_weights:
                mask = attn_mask  # causal, the one query (the last) sees every key, or its window's
                if causal and self.window is not None:
                    mask = causal_mask(1, k.values.size(2), q.device, self.window, self.attn_sinks)
                return attend_quantized(q, k, v, mask, self.sink_logit, scale)
            k, v = (x.values.to(q.dtype) * x.scales.to(q.dtype) for x in (k, v))  # to the naive path
        window, dropout_p = self.window if causal else None, self.dropout if self.training else 0.0
        if self.backend == "sdpa" and not self.keep_weights:
            return attend_sdpa(q, k, v, causal, window, self.attn_sinks, self.sink_logit, attn_mask,
                               dropout_p, scale)
        out = attend_naive(q, k, v, causal, window, self.attn_sinks, self.sink_logit, attn_mask,
                           dropout_p, self.keep_weights, scale)
        if self.keep_weights:
            out, self.weights = out
        return out


class CausalSelfAttention(Attention):
    """Multi-head attention with n_kv_head key/value heads: MHA, GQA and MQA are this class."""

    def __init__(self, config: GPTConfig, layer_idx: int = 0):
        super().__init__(config, layer_idx)
        self.n_kv_head = config.n_kv_head
        self.kv_dim = config.n_kv_head * config.head_dim if self.makes_kv else 0
        q_dim = config.n_head * config.head_dim
        qkv_bias = config.bias if config.qkv_bias is None else config.qkv_bias
        self.qkv = nn.Linear(config.n_embd, q_dim + 2 * self.kv_dim, bias=qkv_bias)  # [q, k, v]
        self.proj = nn.Linear(q_dim, config.n_embd, bias=config.bias)
        self.q_norm = make_norm(config, config.head_dim) if config.qk_norm else None
        self.k_norm = make_norm(config, config.head_dim) if config.qk_norm and self.makes_kv else None

    def forward(self, x, rope=None, kv_cache=None, input_pos=None, attn_mask=None, shared_kv=None,
                cache_len=None, pad=None):
        """x (B, T, n_embd) -> (out (B, T, n_embd), the (k, v) attended over). With `kv_cache`, the new
        K/V go to positions `input_pos` (T,) and the queries attend over what the cache reads
        (GroupCache.key_positions; `pad` (B,) places each row's sinks). `attn_mask` says which keys each
        query sees; without one, plainly causal (within the window): SDPA's fused kernels. A layer
        that makes no K/V attends over `shared_kv`. The queries and keys are one tensor until RoPE
        has rotated both in one go. (split_with_sizes: split's list form without its Python wrapper.)"""
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
        if self.makes_kv:
            if kv_cache is not None:
                k, v = kv_cache.groups[self.kv_group].update(input_pos, k, v, cache_len, pad)
        else:
            k, v = shared_kv
        out = self.attend(q, k, v, attn_mask)                              # (B, n_head, T, hd)
        out = out.transpose(1, 2).reshape(B, T, self.n_head * self.head_dim)  # (B, T, n_head * hd)
        return self.proj(out), (k, v)


class LatentAttention(Attention):
    """Multi-head latent attention (MLA; DeepSeek-V2, 2024, section 2.1; README, "Attention variants").

    Per position, a normalised latent c (width L) and a RoPE key k_r (width R) shared by all heads;
    head h's key is [W_k[h] c, k_r] and its value W_v[h] c, W_k[h] and W_v[h] of shape (hd, L). Without a
    cache, the plain form expands them per head (MHA with d_k = hd + R, d_v = hd). With one, the absorbed
    form attends with W_k[h]^T q_h over the cached [c, k_r] (one K/V head) and applies W_v[h] after:
    since q_h . W_k[h] c = (W_k[h]^T q_h) . c, both forms compute the same function.
    """

    def __init__(self, config: GPTConfig, layer_idx: int = 0):
        super().__init__(config, layer_idx)
        self.latent_dim, self.rope_dim = config.mla_latent_dim, config.mla_rope_dim
        hd, L, R = self.head_dim, self.latent_dim, self.rope_dim
        self.q = nn.Linear(config.n_embd, config.n_head * (hd + R), bias=config.bias)  # per head: [q, q_r]
        if self.makes_kv:
            self.kv_down = nn.Linear(config.n_embd, L + R, bias=config.bias)  # [c before its norm, k_r]
            self.kv_norm = make_norm(config, L)
        # Per head, the key then the value up-projection. A Parameter, not a Linear: the absorbed form
        # multiplies by it per head (and int8 decoding, which converts Linears, leaves it alone).
        self.kv_up = nn.Parameter(torch.randn(2 * config.n_head * hd, L) * 0.02)  # (2 * n_head * hd, L)
        self.proj = nn.Linear(config.n_head * hd, config.n_embd, bias=config.bias)

    def forward(self, x, rope=None, kv_cache=None, input_pos=None, attn_mask=None, shared_kv=None,
                cache_len=None, pad=None):
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
                latent, _ = kv_cache.groups[self.kv_group].update(input_pos, latent, None, cache_len, pad)
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
        out = out.transpose(1, 2).reshape(B, T, self.n_head * hd)       # (B, T, n_head * hd)
        return self.proj(out), latent
