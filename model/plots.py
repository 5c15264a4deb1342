"""Figures: a run's loss curves (train.py's loss.png) and one layer's attention heatmaps
(generate.py's attn_plot). matplotlib is imported only when a figure is drawn."""

import logging
from pathlib import Path

import torch

from model.run_dir import read_metrics


def pyplot():
    """matplotlib.pyplot drawing to files (no screen needed)."""
    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # Hydra sets INFO for all loggers
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path, grid_axis: str = "both") -> None:
    """Finish a one-axes figure (a light grid), write it as a PNG and free it."""
    fig.axes[0].grid(alpha=0.3, axis=grid_axis)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    pyplot().close(fig)


def plot_losses(run_dir: Path, png_path: Path) -> None:
    """Training loss per logged step, and train/val loss at each evaluation, from the run's
    metrics.jsonl."""
    plt = pyplot()
    records = read_metrics(run_dir)
    fig, ax = plt.subplots(figsize=(6, 4))
    steps = [(r["step"], r["loss"]) for r in records if "loss" in r]
    if steps:
        ax.plot(*zip(*steps), alpha=0.4, label="train (batch)")
    for key in ("train_loss", "val_loss"):
        points = [(r["step"], r[key]) for r in records if key in r]
        if points:
            ax.plot(*zip(*points), marker="o", label=key.replace("_", " "))
    ax.set(xlabel="step", ylabel="cross-entropy loss")
    ax.legend()
    save_figure(fig, png_path)


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


def plot_attention(model, ids: list[int], labels: list[str], layer: int, path) -> None:
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
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)  # several axes: save_figure's grid is for one
