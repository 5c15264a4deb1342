"""Training-free conversions of a pretrained RoPE GPT to a smaller KV cache: fewer K/V heads, K/V
shared across layers, or multi-head latent attention.

Each takes a GPT (e.g. GPT.from_pretrained of a Llama) and returns a new one in its dtype, device
and mode, whose config says what changed. Pooling heads and merging layers change the function;
uptraining recovers it (GQA, section 2.1). The MLA retrofit (MHA2MLA, Ji et al. 2025) keeps some
RoPE pairs per K/V head, makes the rest position-free and factorises those keys and the values by
one truncated SVD: with every pair kept at full rank it is the same function, to rounding.
"""

import dataclasses
import math

import torch

from model.config import check_integer
from model.convert import mean_pool_kv
from model.gpt import GPT


def pool_kv_heads(model: GPT, n_kv_head: int) -> GPT:
    """The model with n_kv_head K/V heads (1: MQA), each the mean of a group of consecutive old ones
    (model.convert.mean_pool_kv)."""
    state, config = mean_pool_kv(model.state_dict(), model.config, n_kv_head)
    return rebuilt(model, config, state)


def share_kv(model: GPT, share: int) -> GPT:
    """The model whose groups of `share` adjacent layers attend over their first layer's K/V (kv_share;
    the last group may be shorter); the later layers keep their queries alone. The simple merge, as
    GQA's mean-pooling is: the first layer's K and V rows (biases and qk-norm's key weight too) are
    the mean of its group's. share=1: the same model."""
    c = model.config
    if c.mla_latent_dim is not None:
        raise ValueError("share_kv: the model uses multi-head latent attention (mla_latent_dim), whose "
                         "latents are not K/V heads to merge")
    if c.kv_share != 1:
        raise ValueError(f"share_kv: the model already shares K/V (kv_share={c.kv_share})")
    check_integer(share, "share", 1, c.n_layer)
    q_dim, state = c.n_head * c.head_dim, model.state_dict()
    merged = dict(state)
    for first in range(0, c.n_layer, share):
        group = [f"blocks.{i}.attn." for i in range(first, min(first + share, c.n_layer))]
        for name in ("qkv.weight", "qkv.bias", "k_norm.weight"):
            if group[0] + name not in state:
                continue
            rows = slice(q_dim, None) if name.startswith("qkv") else slice(None)  # the K/V part
            mean = torch.stack([state[layer + name][rows].float() for layer in group]).mean(0)
            merged[group[0] + name] = torch.cat([state[group[0] + name][:q_dim], mean]) \
                if name.startswith("qkv") else mean
            for layer in group[1:]:
                if name.startswith("qkv"):
                    merged[layer + name] = state[layer + name][:q_dim]  # (q_dim, ...): queries alone
                else:
                    del merged[layer + name]
    return rebuilt(model, dataclasses.replace(c, kv_share=share), merged)


def check_retrofit(model: GPT, caller: str, absorbed: bool) -> None:
    """The model has RoPE K/V heads in every layer (and with `absorbed`, keys an MLA layer can absorb
    into its queries), or a one-line ValueError naming `caller`."""
    c = model.config
    qkv_bias = c.bias if c.qkv_bias is None else c.qkv_bias
    refusals = [(c.mla_latent_dim is not None, "already uses multi-head latent attention (mla_latent_dim)"),
                (c.pos_emb != "rope", f"has {c.pos_emb} positions, not RoPE (pos_emb)"),
                (c.kv_share > 1, f"shares K/V across layers (kv_share={c.kv_share})"),
                (absorbed and c.qk_norm, "normalises each head's key (qk_norm), which no latent absorbs"),
                (absorbed and qkv_bias, "has biases on q, k and v (bias / qkv_bias)")]
    for wrong, why in refusals:
        if wrong:
            raise ValueError(f"{caller}: the model {why}")


@torch.no_grad()
def rope_pair_scores(model: GPT, tokens: torch.Tensor) -> torch.Tensor:
    """MHA2MLA's 2-norm criterion (section 3.1): (n_layer, n_kv_head, head_dim / 2), for each layer,
    K/V head g and frequency pair f (dims f and f + head_dim / 2), the mean over the calibration
    `tokens` (B, T) of |k_g,f| times the sum over g's query heads h of |q_h,f|. RoPE turns a pair
    without changing its norm, so q and k are taken unrotated. Run it on a model in eval mode."""
    check_retrofit(model, "rope_pair_scores", absorbed=False)
    c = model.config
    half, rep = c.head_dim // 2, c.n_head // c.n_kv_head
    scores = []

    def pair_norms(x):  # (B, heads, T, hd) -> (B, heads, T, half)
        return x.float().unflatten(-1, (2, half)).norm(dim=-2)

    def score(attn, args):
        q, k, _ = attn.heads(args[0], rope=None)                         # (B, n_head|n_kv_head, T, hd)
        q_sum = pair_norms(q).unflatten(1, (c.n_kv_head, rep)).sum(2)    # (B, n_kv_head, T, half)
        scores.append((pair_norms(k) * q_sum).mean(dim=(0, 2)))          # (n_kv_head, half)

    hooks = [block.attn.register_forward_pre_hook(score) for block in model.blocks]
    try:
        model(tokens, last_only=True)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack(scores)                                           # (n_layer, n_kv_head, half)


def mla_retrofit(model: GPT, latent_dim: int, rope_pairs: int, scores: torch.Tensor | None = None) -> GPT:
    """The model as multi-head latent attention (MHA2MLA), decoded in its absorbed form.

    Each K/V head keeps RoPE on `rope_pairs` of its head_dim / 2 pairs: those of highest `scores`
    (rope_pair_scores', summed over the layers, each layer's normalised to one vote: one set of
    frequencies, mla_rope_pairs, serves every layer), or without scores the fastest-turning 0 ..
    rope_pairs - 1 (MHA2MLA's S_high). The rest of its key loses RoPE. Those position-free key
    rows of every K/V head and all value rows, M (rows, n_embd), are factorised by one truncated SVD,
    M ~ U_L S_L V_L^T: the latent is sqrt(S_L) V_L^T x (latent_dim wide, not normalised), each
    head's keys and values U_L sqrt(S_L) c. The shared RoPE key is every K/V head's kept pairs
    (first halves, then second halves); a query head's RoPE query is its K/V head's block, zero
    elsewhere, and its position-free query its kept dims' complement padded with zeros. At full
    rank, latent_dim = min(rows of M, n_embd), it is exactly the model with RoPE on the kept pairs
    alone (the partial-RoPE model; with every pair kept, the model itself): only the truncation
    loses more. A retrofit's cache holds latent_dim + 2 n_kv_head rope_pairs numbers a layer."""
    check_retrofit(model, "mla_retrofit", absorbed=True)
    check_latent_sizes(model.config, latent_dim, rope_pairs)
    c = model.config
    hd, half, n_kv = c.head_dim, c.head_dim // 2, c.n_kv_head
    if scores is None:
        pairs = torch.arange(rope_pairs).expand(n_kv, rope_pairs)         # (n_kv_head, rope_pairs)
    else:
        if tuple(scores.shape) != (c.n_layer, n_kv, half):
            raise ValueError(f"mla_retrofit: scores must be rope_pair_scores' (n_layer, n_kv_head, "
                             f"head_dim / 2) = {(c.n_layer, n_kv, half)}, got {tuple(scores.shape)}")
        votes = scores.double().cpu() / scores.double().cpu().sum(-1, keepdim=True).clamp_min(1e-300)
        pairs = votes.sum(0).topk(rope_pairs, dim=-1).indices.sort(-1).values  # (n_kv_head, rope_pairs)
    config = dataclasses.replace(c, n_kv_head=c.n_head, mla_latent_dim=latent_dim,
                                 mla_rope_dim=2 * n_kv * rope_pairs, mla_kv_norm=False,
                                 mla_rope_pairs=pairs.flatten().tolist())
    state = {k: v for k, v in model.state_dict().items() if ".attn.qkv." not in k}
    for i, block in enumerate(model.blocks):
        layer = f"blocks.{i}.attn."
        state |= {layer + k: v for k, v in latent_layer(block.attn.qkv.weight, c, pairs, latent_dim).items()}
        if config.bias:  # (biases on the output projection alone: q and the latent have none)
            state[layer + "q.bias"] = torch.zeros(c.n_head * (hd + config.mla_rope_dim))
            state[layer + "kv_down.bias"] = torch.zeros(latent_dim + config.mla_rope_dim)
    return rebuilt(model, config, state)


def check_latent_sizes(config, latent_dim: int, rope_pairs: int) -> None:
    """rope_pairs in 1 .. head_dim / 2 (0: no positions at all, which MLA with RoPE refuses) and
    latent_dim in 1 .. the full rank, min(rows of M, n_embd); else a ValueError naming the argument."""
    hd = config.head_dim
    check_integer(rope_pairs, "rope_pairs", 1, hd // 2)
    rows = config.n_kv_head * (hd - 2 * rope_pairs) + config.n_kv_head * hd
    check_integer(latent_dim, "latent_dim", 1, min(rows, config.n_embd))


def latent_layer(qkv: torch.Tensor, c, pairs: torch.Tensor, L: int) -> dict:
    """One layer's MLA weights (q, kv_down, kv_up) from its qkv weight (mla_retrofit), in float64."""
    hd, half, n_kv, C = c.head_dim, c.head_dim // 2, c.n_kv_head, c.n_embd
    r, R, group = pairs.size(1), 2 * n_kv * pairs.size(1), torch.arange(c.n_head) // (c.n_head // n_kv)
    w_q, w_k, w_v = qkv.detach().cpu().double().split([c.n_head * hd, n_kv * hd, n_kv * hd])
    w_q, w_k, w_v = (w.view(-1, hd, C) for w in (w_q, w_k, w_v))   # (heads, hd, C)
    position_free = torch.ones(n_kv, hd, dtype=torch.bool)
    position_free.scatter_(1, torch.cat([pairs, pairs + half], dim=1), False)
    nope = torch.arange(hd).expand(n_kv, hd)[position_free].view(n_kv, hd - 2 * r)  # (n_kv, hd - 2r)

    def rows(w, index):  # w (heads, hd, C), index (heads, n) -> (heads, n, C)
        return w.gather(1, index[..., None].expand(-1, -1, C))

    M = torch.cat([rows(w_k, nope).reshape(-1, C), w_v.reshape(-1, C)])  # (n_kv * (2hd - 2r), C)
    U, S, Vh = torch.linalg.svd(M, full_matrices=False)
    down = S[:L].sqrt()[:, None] * Vh[:L]                                # (L, C)
    up_k, up_v = (U[:, :L] * S[:L].sqrt()).split([n_kv * (hd - 2 * r), n_kv * hd])
    k_rope = torch.cat([rows(w_k, pairs), rows(w_k, pairs + half)], dim=1)  # (n_kv, 2r, C): halves
    k_rope = k_rope.view(n_kv, 2, r, C).transpose(0, 1).reshape(R, C)    # (R, C): all first halves first
    q_rope = torch.zeros(c.n_head, 2, n_kv, r, C, dtype=torch.float64)  # (n_head, half, K/V head, r, C)
    heads = torch.arange(c.n_head)
    q_rope[heads, 0, group] = rows(w_q, pairs[group])                    # (n_head, r, C)
    q_rope[heads, 1, group] = rows(w_q, pairs[group] + half)
    padding = torch.zeros(c.n_head, 2 * r, C, dtype=torch.float64)
    q_nope = torch.cat([rows(w_q, nope[group]), padding], dim=1)         # (n_head, hd, C)
    q = torch.cat([q_nope, q_rope.view(c.n_head, R, C)], dim=1)          # (n_head, hd + R, C)
    up_k = torch.cat([up_k.view(n_kv, hd - 2 * r, L)[group],           # (n_head, hd - 2r, L)
                      torch.zeros(c.n_head, 2 * r, L, dtype=torch.float64)], dim=1)  # (n_head, hd, L)
    up_v = up_v.view(n_kv, hd, L)[group]                                 # (n_head, hd, L)
    # MLA scales scores by 1/sqrt(hd + R), the old layer by 1/sqrt(hd): the difference goes into q.
    return {"q.weight": q.reshape(-1, C) * math.sqrt((hd + R) / hd),     # (n_head * (hd + R), C)
            "kv_down.weight": torch.cat([down, k_rope]),                 # (L + R, C)
            "kv_up": torch.cat([up_k, up_v]).reshape(2 * c.n_head * hd, L)}  # (2 * n_head * hd, L)


def rebuilt(model: GPT, config, state: dict) -> GPT:
    """A new GPT of `config` holding `state`, in `model`'s dtype, device and training mode."""
    weight, vocab = model.wte.weight, config.vocab_size
    state = {k: v[:vocab] if k in ("wte.weight", "lm_head.weight") else v  # (pad_head_rows' rows cut)
             for k, v in state.items() if not (config.tie_embeddings and k == "lm_head.weight")}
    new = GPT.from_state(config, state, weight.dtype, "the converted weights", "the converted config")
    return new.to(weight.device).train(model.training)
