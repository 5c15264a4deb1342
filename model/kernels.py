"""Faster attention kernels, which the core `attend` hands the calls they take (its KERNELS). They
are split-KV flash-decoding for a compiled step's one query (FlexAttention), and an int8 cache's
one-token step read as stored, with when each compiles. model/attention.py registers them."""

import functools
import math

import torch

from model.kv_cache import Quantized
from model.windows import without_sink


def split_kv_step(q, k, v, attn_mask, is_causal, dropout_p, scale, backend, return_weights):
    """attend's kernel for one query per row inside a `SplitKV` context (a compiled CUDA step) where
    `splits_kv` takes its heads and mask: attend_split_kv. None for any other call."""
    if not SplitKV.on or q.size(2) != 1 or backend != "sdpa" or return_weights:
        return None
    mask, sink_logit = without_sink(attn_mask)
    if (mask is not None and mask.dtype != torch.bool) or not splits_kv(q.size(-1), v.size(-1), mask):
        return None
    return attend_split_kv(q, k, v, mask, sink_logit, scale)


def int8_step(q, k, v, attn_mask, is_causal, dropout_p, scale, backend, return_weights):
    """attend's kernel for an int8 cache's one-token step, whose K and V come `Quantized` (as stored):
    attend_quantized. None for any other call."""
    if not isinstance(k, Quantized):
        return None
    mask, sink_logit = without_sink(attn_mask)
    return attend_quantized(q, k, v, mask, sink_logit, scale)


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
    S positions across thread blocks (SDPA's run one per row and head: 12 at batch 1 on a GPU of 132
    multiprocessors), and a second pass combines their parts by their log-sum-exps. q (B, n_head, 1,
    d_k), k and v (B, n_kv_head, S, .) -> (B, n_head, 1, d_v); the n_rep query heads of a K/V head
    are its n_rep queries. `mask` (bool) is one row per batch row; gpt-oss's `sink_logit` (n_head,)
    scales each head's output by the share the sink leaves, sigmoid(lse - sink)."""
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
    """Whether attend_split_kv takes this call: heads a power of two from 16 wide (FlexAttention pads
    others: MLA's 288 to 512 ran 1.4-1.7x slower than SDPA on an H200), a mask the same for every head."""
    heads_fit = all(d >= 16 and d & (d - 1) == 0 for d in (d_k, d_v))
    return heads_fit and (mask is None or mask.dim() < 4 or mask.size(1) == 1)


def decode_kernel_options(rows: int, head_dim: int, itemsize: int) -> dict:
    """FlexAttention's decoding kernel configuration inside a compiled step on Hopper or newer: from
    16 `rows` (batch x K/V heads), tiles of up to 128 keys (16 KB) in 3 stages (inductor's default ran
    up to 2.1x slower on an H200); below, the default."""
    if rows < 16:
        return {}
    return {"num_stages": 3, "BLOCK_N": max(16, min(128, 16384 // (head_dim * itemsize)))}


def flex_decode(q, k, v, score_mod=None, scale=None, lse=False, kernel_options=None):
    """flex_attention over every key in blocks of 128, by which its decoding kernel splits them; with
    lse, (out, each query's log-sum-exp). kernel_options: decode_kernel_options', or None."""
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
    # Inductor times the decoding kernel's configurations for this shape and keeps the fastest: its
    # default keeps little in flight (an H200's MHA step at batch 256: 42,228 -> 68,804 tokens/s).
    return torch.compile(flex, dynamic=False, fullgraph=True,
                         options={"max_autotune": True, "max_autotune_gemm_backends": "ATEN"})


def attend_one_query(q, k: Quantized, v: Quantized, attn_mask=None, sink_logit=None, scale=None):
    """`attend` for one query per row over an int8 cache as stored: q (B, n_head, 1, d_k), k and v
    `Quantized` (int8 (B, n_kv_head, S, d), scales (.., 1)) -> (B, n_head, 1, d_v). The scales factor
    out of both sums, q . (s_j k_j) = s_j (q . k_j) and sum_j w_j (s_j v_j) = sum_j (w_j s_j) v_j, so
    no float K or V is made: compiled, the cache is read once, as int8."""
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
    """Its own compiled kernel for an eager model's int8 steps (dynamic: one graph for every layer and
    step of a sample), made on first use; inside the compiled decode step it is traced instead."""
    return torch.compile(attend_one_query, dynamic=True)


# The compiled kernel saved ~2-9 ns per int8 number of K a step read, nothing below ~2^17 a step;
# compiling it took 18-37 s (~5 s from inductor's disk cache). docs/variants.md has the numbers.
COMPILE_FROM = 2**18  # int8 numbers a group's cache holds from which the compiled kernel is the faster
PAYS_FROM = 2**32  # int8 numbers of K a decode's steps read, all layers, that save a cold compile


def compiling_pays(cache, positions: int, steps: int, layers: int) -> bool:
    """Whether `steps` one-token steps after `positions` cached ones, by `layers` layers over
    `cache`'s groups, read PAYS_FROM int8 numbers of K (each its group's cells written so far)."""
    a_step = sum(group.k.tensors[0][:, :, 0].numel() * min(group.cells, positions + steps / 2)
                 for group in cache.groups)  # (rows x heads x dim numbers a cell) x cells, on average
    return steps * a_step * layers / len(cache.groups) >= PAYS_FROM


def attend_quantized(q, k: Quantized, v: Quantized, attn_mask=None, sink_logit=None, scale=None):
    """attend_one_query, compiled or not as one_query_kernel says."""
    return one_query_kernel(q, k)(q, k, v, attn_mask, sink_logit, scale)


def one_query_kernel(q, k: Quantized):
    """attend_one_query as an int8 step runs it: traced into the caller's graph, or through its own
    compiled kernel; as written while a CUDA graph captures it, over a group cache too small for the
    compiled kernel to be faster (COMPILE_FROM: a cache keeps one kernel from its first step to its
    last), and for a decode too short to pay for compiling it (k.may_compile, set by `stream`)."""
    if torch.compiler.is_compiling():
        return attend_one_query
    group_numbers = k.values.untyped_storage().nbytes() // k.values.element_size()
    as_written = (not k.may_compile or group_numbers < COMPILE_FROM
                  or (q.is_cuda and torch.cuda.is_current_stream_capturing()))
    return attend_one_query if as_written else compiled_attend_one_query()
