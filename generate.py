"""Sample from a trained checkpoint, with or without the KV cache.

    python generate.py ckpt=outputs/... prompt="ROMEO:" max_new_tokens=500 num_samples=3
    python generate.py ckpt=... kv_cache=false      # the uncached reference path
    python generate.py ckpt=... benchmark=true      # tokens/s with and without the cache
    python generate.py ckpt=... attn_plot=attn.png  # the prompt's attention heatmaps

`sample(cfg)` does the work and is callable from Python; `main` is the Hydra wrapper.
"""

import sys
import time
from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig
from torch.nn.attention import SDPBackend, sdpa_kernel

from data.tokenizer import DataError, tokenizer_from_meta
from model import GPT, GPTConfig
from model.gpt import left_pad
from model.quantize import quantize_int8
from train import RunError, checkpoint_file, exit_on_user_error, load_checkpoint, load_weights, pick_device

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def load_model(path, device, dtype: str = "float32", quantize: str | None = None) -> tuple[GPT, dict]:
    """The GPT of a checkpoint in eval mode, in `dtype`, optionally with int8 weights, and
    its checkpoint dict."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if quantize not in (None, "int8"):
        raise ValueError(f"quantize must be null or int8, got {quantize!r}")
    ckpt = load_checkpoint(checkpoint_file(path, prefer="best.pt"))
    model = GPT(GPTConfig(**ckpt["model_config"]))
    try:
        load_weights(model, ckpt["model"])
    except RuntimeError as e:
        lines = str(e).splitlines()
        raise RunError(f"checkpoint {path}: weights do not match its model config "
                       f"({lines[1].strip() if len(lines) > 1 else e})") from None
    if quantize == "int8":
        quantize_int8(model)
    return model.to(device=device, dtype=DTYPES[dtype]).eval(), ckpt


def compile_decode_step(model: GPT):
    """The one-token step compiled once with fixed shapes: the static cache never changes shape
    and the position comes in as a tensor, so there is one graph (CUDA graphs on GPU)."""
    on_cuda = model.wte.weight.is_cuda

    def logits_at(token, input_pos, cache, pad):
        # On CPU, one query against the cache is faster as SDPA's math formulation (which
        # inductor fuses) than through its flash kernel.
        with sdpa_kernel(list(SDPBackend) if on_cuda else [SDPBackend.MATH]):
            return model.logits_at(token, input_pos, cache, pad)

    step = torch.compile(logits_at, mode="reduce-overhead" if on_cuda else None, dynamic=False,
                         fullgraph=True)

    def decode_step(token, cache, pad):
        input_pos = torch.tensor([cache.length], device=token.device)
        logits = step(token, input_pos, cache, pad)
        cache.length += 1
        return logits[:, -1]

    return decode_step


def check_options(cfg) -> None:
    if cfg.max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {cfg.max_new_tokens}")
    if cfg.top_p is not None and not 0.0 < cfg.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {cfg.top_p}")
    if cfg.temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {cfg.temperature}")
    if cfg.num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {cfg.num_samples}")


def read_prompts(cfg) -> list[str]:
    if cfg.prompt_file:
        path = Path(cfg.prompt_file).expanduser()
        if not path.is_file():
            raise DataError(f"prompt_file not found: {path}")
        prompts = [line for line in path.read_text().splitlines() if line]
        if not prompts:
            raise DataError(f"prompt_file {path} has no prompts")
    else:
        prompts = [str(cfg.prompt)]
    if any(p == "" for p in prompts):
        raise DataError("the prompt is empty: give at least one character, e.g. prompt='\\n'")
    return [p for p in prompts for _ in range(cfg.num_samples)]


def sample(cfg: DictConfig, out=sys.stdout) -> list[str]:
    """Generate as cfg says; prints the samples (a single one streams) and returns their texts."""
    check_options(cfg)
    device = pick_device(cfg.device)
    model, ckpt = load_model(cfg.ckpt, device, cfg.dtype, cfg.quantize)
    tokenizer = tokenizer_from_meta(ckpt["data_meta"], cfg.bpe_path)
    prompts = read_prompts(cfg)
    encoded = [tokenizer.encode(p) for p in prompts]
    if cfg.attn_plot:
        plot_attention(model, encoded[0], tokenizer, cfg.attn_layer, cfg.attn_plot)
        print(f"attention of layer {cfg.attn_layer} saved to {cfg.attn_plot}", file=out)
    decode_step = compile_decode_step(model) if cfg.compile and cfg.kv_cache else None
    if cfg.benchmark:
        print_benchmark(model, encoded[0], cfg.max_new_tokens, device, out, decode_step)
        return []

    idx, pad = left_pad(encoded, device)
    generator = torch.Generator(device=device).manual_seed(cfg.seed)
    stream = model.stream(idx, cfg.max_new_tokens, temperature=cfg.temperature, top_k=cfg.top_k,
                          top_p=cfg.top_p, kv_cache=cfg.kv_cache, generator=generator, pad=pad,
                          decode_step=decode_step)
    new_ids = [[] for _ in prompts]
    texts = [""] * len(prompts)
    streaming = len(prompts) == 1
    if streaming:
        print(prompts[0], end="", file=out, flush=True)
    for tokens in stream:
        for row, token in enumerate(tokens.tolist()):
            if cfg.stop and cfg.stop in texts[row]:
                continue
            new_ids[row].append(token)
            text = tokenizer.decode(new_ids[row])
            if cfg.stop and cfg.stop in text:
                text = text[: text.index(cfg.stop) + len(cfg.stop)]
            if streaming:
                print(text[len(texts[row]):], end="", file=out, flush=True)
            texts[row] = text
        if cfg.stop and all(cfg.stop in t for t in texts):
            break
    if streaming:
        print(file=out)
    else:
        for i, (prompt, text) in enumerate(zip(prompts, texts)):
            print(f"{'=' * 20} sample {i + 1}/{len(prompts)} {'=' * 20}\n{prompt}{text}", file=out)
    return [p + t for p, t in zip(prompts, texts)]


def timed_stream(model, idx, max_new_tokens, kv_cache, device, decode_step=None):
    """(seconds to the first token, seconds for the rest) of one greedy generation."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    stream = model.stream(idx, max_new_tokens, temperature=0, kv_cache=kv_cache, decode_step=decode_step)
    next(stream)
    sync()
    t1 = time.perf_counter()
    for _ in stream:
        pass
    sync()
    return t1 - t0, time.perf_counter() - t1


def print_benchmark(model, prompt_ids, max_new_tokens, device, out=sys.stdout, decode_step=None) -> None:
    """Prefill and decode tokens/s with and without the cache, and the cache's size."""
    idx = torch.tensor([prompt_ids[-model.config.block_size:]], device=device)
    n = max(2, max_new_tokens)
    timed_stream(model, idx, n, True, device, decode_step)  # warm-up (and compile) at these shapes
    rows = []
    for kv_cache in (True, False):
        prefill_s, decode_s = timed_stream(model, idx, n, kv_cache, device, decode_step)
        rows.append((kv_cache, idx.size(1) / prefill_s, (n - 1) / decode_s))
    c = model.config
    cache = model.new_kv_cache(1)
    print(f"model: {c.n_layer} layers, n_head={c.n_head} n_kv_head={c.n_kv_head} "
          f"n_embd={c.n_embd}, {cache.k[0].dtype}, prompt {idx.size(1)} tokens, {n} new tokens, "
          f"batch 1, {device}{', compiled decode step' if decode_step else ''}", file=out)
    print("| kv cache | prefill tokens/s | decode tokens/s |\n| --- | --- | --- |", file=out)
    for kv_cache, prefill, decode in rows:
        print(f"| {'on' if kv_cache else 'off'} | {prefill:,.0f} | {decode:,.1f} |", file=out)
    print(f"decode speed-up from the cache: {rows[0][2] / rows[1][2]:.1f}x", file=out)
    print(f"KV cache: {cache.bytes_per_token:,} bytes per token "
          f"(2 x {c.n_layer} layers x {c.n_kv_head} kv heads x {c.head_dim} x "
          f"{cache.k[0].element_size()} bytes), {cache.nbytes / 2**20:.2f} MB at block_size "
          f"{c.block_size}", file=out)


def plot_attention(model: GPT, prompt_ids, tokenizer, layer: int, path) -> None:
    """One heatmap per head of `layer`'s attention over the prompt (naive backend)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not 0 <= layer < model.config.n_layer:
        raise ValueError(f"attn_layer must be in 0..{model.config.n_layer - 1}, got {layer}")
    ids = prompt_ids[-model.config.block_size:]
    attn = model.blocks[layer].attn
    attn.keep_weights = True
    try:
        with torch.no_grad():
            model(torch.tensor([ids], device=model.wte.weight.device))
        weights = attn.weights[0].float().cpu()                    # (n_head, T, T)
    finally:
        attn.keep_weights, attn.weights = False, None
    labels = [repr(tokenizer.decode([i]))[1:-1] for i in ids]
    n_head = weights.size(0)
    cols = min(4, n_head)
    rows = -(-n_head // cols)
    size = max(3.0, 0.25 * len(ids))
    fig, axes = plt.subplots(rows, cols, figsize=(size * cols, size * rows), squeeze=False)
    for h, ax in enumerate(axes.flat):
        if h >= n_head:
            ax.axis("off")
            continue
        ax.imshow(weights[h], cmap="viridis", vmin=0, vmax=1)
        ax.set_title(f"layer {layer}, head {h} (kv head {h // (n_head // model.config.n_kv_head)})")
        ax.set_xticks(range(len(ids)), labels, rotation=90, fontsize=7)
        ax.set_yticks(range(len(ids)), labels, fontsize=7)
        ax.set_xlabel("key")
        ax.set_ylabel("query")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


@hydra.main(config_path="configs", config_name="generate", version_base="1.3")
def main(cfg: DictConfig) -> None:
    exit_on_user_error(sample, cfg)


if __name__ == "__main__":
    main()
