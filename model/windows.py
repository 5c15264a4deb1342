"""Windows and sinks, what they add to the core `attend`. Here is the one visibility rule every mask
comes from (causal, within a sliding window, StreamingLLM's first positions kept, rows' left padding),
and gpt-oss's learned sink logit, which joins every softmax as one more key."""

from typing import NamedTuple

import torch

from model.core.attention import attend


def visible(query_pos, key_pos, window=None, attn_sinks=0, starts=None) -> torch.Tensor:
    """Which keys a query may attend to: the one rule every mask comes from (training, a prompt's
    prefill, its chunks, the one-token step over any cache). True where the query at query_pos (T,)
    may see the key at key_pos (S,) or (B, S): a written position (-1: a cell that holds none to
    see) at or before it, within `window` of it or one of the row's first `attn_sinks` positions
    (StreamingLLM's sinks), and not a row's left padding (starts (B,): the column of its position 0)
    unless the query is one too, so that no row is empty (NaN). (T, S), or with starts (B, 1, T, S)."""
    key_pos = key_pos[..., None, :]                                  # (1, S) or (B, 1, S)
    distance = query_pos[:, None] - key_pos                          # (T, S) or (B, T, S)
    mask = (distance >= 0) & (key_pos >= 0)
    row_start = 0 if starts is None else starts[:, None, None]             # (B, 1, 1): each row's position 0
    if window is not None:
        mask = mask & ((distance < window) | (key_pos - row_start < attn_sinks))
    if starts is None:
        return mask
    is_pad_key = key_pos < row_start                                 # (B, 1, S)
    is_pad_query = query_pos[:, None] < row_start                    # (B, T, 1)
    return (mask & (~is_pad_key | is_pad_query)).unsqueeze(1)        # (B, 1, T, S)


def causal_mask(T: int, S: int, device=None, window: int | None = None, attn_sinks: int = 0) -> torch.Tensor:
    """`visible` for queries at the last T of positions 0 .. S-1 over all S: (T, S), bottom-right."""
    return visible(torch.arange(S - T, S, device=device), torch.arange(S, device=device), window, attn_sinks)


class WithSink(NamedTuple):
    """An attention mask (bool, or None: every key) with gpt-oss's learned sink, a logit per head
    (n_head,) that joins every softmax: the kernels that read it so take it (model/kernels.py), and
    `sink_as_key` makes it one more key for the rest."""

    mask: torch.Tensor | None
    logit: torch.Tensor


def without_sink(attn_mask) -> tuple:
    """(mask, sink logit or None) of an attention mask that may carry a sink (`WithSink`)."""
    return (attn_mask.mask, attn_mask.logit) if isinstance(attn_mask, WithSink) else (attn_mask, None)


def sink_as_key(q, k, v, attn_mask, is_causal, dropout_p, scale, backend, return_weights):
    """attend's kernel for a mask `WithSink` no faster kernel took: the sink as one more key whose
    score is its logit (`with_sink_key`), then `attend`; the weights without it. None for any other call."""
    if not isinstance(attn_mask, WithSink):
        return None
    B, n_head, T, _ = q.shape
    S = k.size(2)
    k, v, bias = with_sink_key(k, v, attn_mask.mask, attn_mask.logit, (B, n_head, T, S), q.dtype)
    out = attend(q, k, v, bias, is_causal=False, dropout_p=dropout_p, scale=scale, backend=backend,
                 return_weights=return_weights)
    return (out[0], out[1][..., :S]) if return_weights else out


def layer_mask(T: int, S: int, device, is_causal=True, attn_mask=None, window=None, attn_sinks=0,
               sink_logit=None) -> tuple:
    """(mask, is_causal) for `attend` from T queries over S keys: causal (within `window`, beside its
    `attn_sinks` first positions) and-ed with `attn_mask`, or `attn_mask` alone; with `sink_logit`,
    a mask `WithSink`."""
    if is_causal and (window is not None or attn_mask is not None or (sink_logit is not None and T > 1)):
        causal = causal_mask(T, S, device, window, attn_sinks)
        attn_mask, is_causal = causal if attn_mask is None else attn_mask & causal, False
    if sink_logit is not None:
        attn_mask, is_causal = WithSink(attn_mask, sink_logit), False
    return attn_mask, is_causal


def attend_within(q, k, v, *, is_causal=True, window=None, attn_sinks=0, sink_logit=None, attn_mask=None,
                  dropout_p=0.0, backend="sdpa", return_weights=False, scale=None):
    """`attend` for a layer with a `window` (and `attn_sinks`) or a `sink_logit`, its arguments checked:
    what the layers compute, callable on its own. `attn_mask` (bool) is and-ed with the causal mask."""
    check_attend_args(q, k, v, backend, return_weights)
    mask, causal = layer_mask(q.size(2), k.size(2), q.device, is_causal, attn_mask, window, attn_sinks,
                              sink_logit)
    return attend(q, k, v, mask, is_causal=causal, dropout_p=dropout_p, scale=scale, backend=backend,
                  return_weights=return_weights)


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
