"""What generate.py reports besides its samples: the benchmark (prefill and decode tokens/s with
and without the cache, the cache's bytes and those of what-if designs) and the heatmaps of a
prompt's attention (`attn_plot`)."""

import dataclasses

import torch

from cli.errors import naming
from model import GPT
from model.device import on_meta
from model.generation import Decoding, left_pad
from model.timing import timed_stream
from training.plots import pyplot, write_figure


def print_benchmark(model, prompts, max_new_tokens: int, decoding: Decoding, out,
                    built_s: float = 0.0) -> None:
    """Prefill and decode tokens/s of the batch `prompts` (lists of ids, left-padded into one), with
    and without the cache, decoded as `decoding` says (its kv_dtype, its decode step), and the
    cache's size. Each prompt keeps what a prefill runs of it; built_s is what building the decode
    step took (compiling or capturing it)."""
    device, c = model.wte.weight.device, model.config
    idx, pad = left_pad([p[-(c.context_size or len(p)):] for p in prompts], device)
    (B, T), n = idx.shape, max(2, max_new_tokens)
    decode_step, kv_dtype = decoding.decode_step, decoding.kv_dtype
    warm_up_s = sum(timed_stream(model, idx, n, dataclasses.replace(decoding, kv_cache=True), pad))
    rows = []
    for kv_cache in (True, False):
        with_or_without = dataclasses.replace(decoding, kv_cache=kv_cache)
        prefill_s, decode_s = timed_stream(model, idx, n, with_or_without, pad)
        rows.append((kv_cache, B * T / prefill_s, B * (n - 1) / decode_s, prefill_s + decode_s))
    cache = meta_cache(c, model.wte.weight.dtype, kv_dtype)
    print(f"model: {c.n_layer} layers, n_head={c.n_head} n_kv_head={c.n_kv_head} n_embd={c.n_embd}, "
          f"{model.wte.weight.dtype}, {device} | batch {B} x prompt {T} tokens"
          f"{' (left-padded)' if pad is not None else ''}, {n} new tokens per row"
          f" | decode step: {decode_step.backend if decode_step else 'eager'}", file=out)
    print("| kv cache | prefill tokens/s | decode tokens/s |\n| --- | --- | --- |", file=out)
    for kv_cache, prefill, decode, _ in rows:
        print(f"| {'on' if kv_cache else 'off'} | {prefill:,.0f} | {decode:,.1f} |", file=out)
    print(f"tokens/s count every row: {B} x {T} prompt tokens, {B} x {n - 1} decoded (the first new "
          f"token comes from the prefill)", file=out)
    built = f"; the decode step was built in {built_s:.2f} s before it (compiled, or captured)"
    print(f"warm-up: {warm_up_s:.2f} s, {warm_up_s - rows[0][3]:.2f} s more than a repeat"
          f"{built if decode_step else ''}", file=out)
    print(f"decode speed-up from the cache: {rows[0][2] / rows[1][2]:.1f}x", file=out)
    scales = " + one scale per position and K/V head" if cache.quantized else ""
    held = ": the window" * cache.ring + " and sinks" * bool(cache.sinks)
    print(f"KV cache in {cache.dtype}: {cache.bytes_per_token:,} bytes per token "
          f"({c.kv_cache_formula()} x {cache.dtype.itemsize} bytes{scales}), {cache.nbytes / 2**20:.2f} MB "
          f"a sequence ({cache.max_len} positions{held}), "
          f"{B * cache.nbytes / 2**20:.2f} MB for the batch", file=out)
    print_kv_what_ifs(c, model.wte.weight.dtype, cache.dtype, out)


def meta_cache(config, dtype, kv_dtype=None, positions=None):
    """The KV cache a model of `config` in `dtype` makes for one sequence of `positions` (default
    block_size), stored in kv_dtype (None: dtype), on the meta device: its shapes, no memory (a
    real model's cache at full context can take gigabytes)."""
    with on_meta():
        return GPT(config).to(dtype).new_kv_cache(1, positions, dtype=kv_dtype)


def print_kv_what_ifs(config, dtype, kv_dtype, out) -> None:
    """The cache's bytes per token of a sequence of block_size positions, by the formula
    (GPTConfig.kv_cache_bytes) and as measured (KVCache.nbytes), for this model and for what-ifs
    of it: its K/V heads as MHA's and as MQA's, an int8 cache, and a window (or, if it has one,
    none): why the model chose its design, as a line of numbers each."""
    c, positions = config, config.block_size
    rows = [("this model", c, kv_dtype)]
    if c.mla_latent_dim is None and c.n_kv_head != c.n_head:
        rows.append((f"as MHA ({c.n_head} K/V heads)", dataclasses.replace(c, n_kv_head=c.n_head), kv_dtype))
    if c.mla_latent_dim is None and c.n_kv_head != 1:
        rows.append(("as MQA (1 K/V head)", dataclasses.replace(c, n_kv_head=1), kv_dtype))
    if kv_dtype != torch.int8:
        rows.append(("an int8 cache", c, torch.int8))
    if c.attn_window is None:
        window = max(1, min(4096, positions // 4))
        rows.append((f"a window of {window:,}", dataclasses.replace(c, attn_window=window), kv_dtype))
    else:
        rows.append(("no window", dataclasses.replace(c, attn_window=None, window_pattern=None, attn_sinks=0),
                     kv_dtype))
    print(f"KV cache per token of a {positions:,}-position sequence (block_size), by the formula and as "
          f"measured (KVCache.nbytes: K, V, scales):\n"
          f"| cache | formula | bytes/token | measured | MiB a sequence | vs this model |\n"
          f"| --- | --- | --- | --- | --- | --- |", file=out)
    base = None
    for name, variant, stored in rows:
        scale_bytes = dtype.itemsize if stored == torch.int8 else 0
        formula = variant.kv_cache_bytes(positions, stored.itemsize, scale_bytes)
        measured = meta_cache(variant, dtype, stored, positions).nbytes
        base = base or measured
        scales = f" + scales x {scale_bytes}" if scale_bytes else ""
        formula_text = variant.kv_cache_formula()
        if variant.attn_window is not None and "windowed" not in formula_text:  # every layer windowed
            sinks = f" + {variant.attn_sinks} sink" if variant.attn_sinks else ""
            formula_text += f", the last {variant.attn_window}{sinks} positions"
        print(f"| {name} | {formula_text} x {stored.itemsize}{scales} | "
              f"{formula / positions:,.0f} | {measured / positions:,.0f} | {measured / 2**20:,.2f} | "
              f"{measured / base:.2f}x |", file=out)


def save_attention_plot(model, prompt: list[int], tokenizer, path, layer: int, out) -> None:
    """attn_plot=path: the heatmaps of the prompt's (last block_size tokens') attention in `layer`,
    written where the run calls it: after what would refuse the sample, so that nothing is written
    or printed for a run that fails."""
    ids = prompt[-model.config.block_size:]
    labels = [repr(tokenizer.decode([i]))[1:-1] for i in ids]
    fig = attention_figure(model, ids, labels, layer)
    with naming("attn_plot"):
        write_figure(fig, path)
    print(f"attention of layer {layer} saved to {path}", file=out)


@torch.no_grad()
def attention_weights(model, ids: list[int], layer: int) -> torch.Tensor:
    """(n_head, T, T): the attention weights of `layer` over the tokens `ids` (naive backend)."""
    if not 0 <= layer < model.config.n_layer:
        raise ValueError(f"attn_layer must be in 0..{model.config.n_layer - 1}, got {layer}")
    attn = model.blocks[layer].attn
    attn.keep_weights = True
    try:
        model(torch.tensor([ids], device=model.wte.weight.device))
        return attn.weights[0].float().cpu()                           # (n_head, T, T)
    finally:
        attn.keep_weights, attn.weights = False, None


def attention_figure(model, ids: list[int], labels: list[str], layer: int):
    """One heatmap per head of `layer`'s attention over the tokens `ids`, labelled `labels`."""
    weights = attention_weights(model, ids, layer)
    plt = pyplot()
    config = model.config
    n_head, group = weights.size(0), config.n_head // config.n_kv_head
    # Which keys a head reads: its K/V head (MLA: its own up-projection of the latent), made by
    # the first layer of this layer's group of kv_share layers.
    source = "" if layer % config.kv_share == 0 else f" of layer {layer - layer % config.kv_share}"
    cols = min(4, n_head)
    rows = -(-n_head // cols)
    size = max(3.0, 0.25 * len(ids))
    fig, axes = plt.subplots(rows, cols, figsize=(size * cols, size * rows), squeeze=False)
    for h, ax in enumerate(axes.flat):
        if h >= n_head:
            ax.axis("off")
            continue
        ax.imshow(weights[h], cmap="viridis", vmin=0, vmax=1)
        kv = f"latent{source}" if config.mla_latent_dim is not None else f"kv head {h // group}{source}"
        ax.set_title(f"layer {layer}, head {h} ({kv})")
        ax.set_xticks(range(len(ids)), labels, rotation=90, fontsize=7)
        ax.set_yticks(range(len(ids)), labels, fontsize=7)
        ax.set(xlabel="key", ylabel="query")
    fig.tight_layout()  # several axes: save_figure's grid is for one
    return fig
