"""Figures: matplotlib set up to draw to files, each written complete or not at all, and a run's
loss curves (its loss.png). matplotlib is imported only when a figure is drawn, or ahead of one in
the background (`import_in_background`)."""

import logging
import threading
from pathlib import Path

from model.checkpoint import write_atomically
from training.run_dir import read_metrics


def pyplot():
    """matplotlib.pyplot drawing to files (no screen needed)."""
    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # Hydra sets INFO for all loggers
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def import_in_background() -> threading.Thread:
    """Import matplotlib (~0.5 s) on a thread, while the GPU trains, so that the loss plot at the
    end does not wait for it (a later `pyplot()` waits for this import to end, if it has not). Not a
    daemon: a run that ends early (a full disk at its first checkpoint) waits for the import before
    Python shuts down: Python 3.11 stops a daemon thread still importing with pthread_exit, which
    inside matplotlib's C++ modules aborts the process ("terminate called without an active
    exception"; the likely cause of one CI run's exit -6 there, on a fresh install)."""
    thread = threading.Thread(target=pyplot, name="matplotlib import")
    thread.start()
    return thread


def save_figure(fig, path, grid_axis: str = "both") -> None:
    """Finish a one-axes figure (a light grid), write it and free it (write_figure)."""
    fig.axes[0].grid(alpha=0.3, axis=grid_axis)
    fig.tight_layout()
    write_figure(fig, path)


def write_figure(fig, path) -> None:
    """Write a figure in the format its file name says (PNG without one), atomically: an earlier
    file at path stays if the write fails; then free it."""
    path = Path(path).expanduser()
    image_format = path.suffix[1:].lower() or "png"  # what savefig(path) would infer from the name
    try:
        write_atomically(path, lambda f: fig.savefig(f, format=image_format, dpi=100), "plot")
    finally:
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
