"""The MHA vs GQA vs MQA study in one command.

    python benchmarks/attention_study.py                            # CPU default, ~5 minutes on 2 cores
    python benchmarks/attention_study.py experiment=shakespeare_char # the GPU preset

Trains each attention variant with everything else identical (data, seed, steps, batch, width),
then measures parameters, best val loss and its curve, KV-cache bytes per token and at block_size,
decode tokens/s with the cache at batch 1 and a large batch, and training tokens/s. Writes
study.md and three PNG plots into the study's run dir (Hydra's output dir).
"""

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import hydra
import torch
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from data.errors import check_command_line, config_object, run_guarded
from model import GPT
from model.checkpoint import load_model
from model.convert import convert_checkpoint
from model.device import pick_device
from model.generation import timed_stream
from model.plots import pyplot, save_figure
from train import train

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@dataclass
class StudyConfig:
    """The `study` node of configs/study.yaml."""

    variants: list[str] = field(default_factory=lambda: ["mha", "gqa", "mqa"])  # attention options
    decode_batch_sizes: list[int] = field(default_factory=lambda: [1, 64])
    uptrain_iters: int = 300  # > 0: also convert the trained MHA model to uptrain_to and uptrain it
    uptrain_to: str = "gqa"
    uptrain_lr: float = 1e-3

    def __post_init__(self):
        options = sorted(p.stem for p in (CONFIGS / "attention").glob("*.yaml"))
        for name, values in (("variants", self.variants), ("uptrain_to", [self.uptrain_to])):
            if unknown := [v for v in values if v not in options]:
                raise ValueError(f"study.{name}: {', '.join(unknown)} is not an option of the attention "
                                 f"group ({', '.join(options)})")
        if not self.variants:
            raise ValueError("study.variants is empty: name at least one attention option")
        if not self.decode_batch_sizes or min(self.decode_batch_sizes) < 1:
            raise ValueError(f"study.decode_batch_sizes must be >= 1 each, got {self.decode_batch_sizes}")
        if self.uptrain_iters < 0:
            raise ValueError(f"study.uptrain_iters must be >= 0, got {self.uptrain_iters}")
        if self.uptrain_lr <= 0:
            raise ValueError(f"study.uptrain_lr must be > 0, got {self.uptrain_lr}")


ConfigStore.instance().store(name="study_schema", package="study", node=StudyConfig)


def variant_config(cfg: DictConfig, variant: str) -> DictConfig:
    """cfg with the attention group's option `variant` applied, as `attention=<variant>` would."""
    out = cfg.copy()
    out.model = OmegaConf.merge(out.model, OmegaConf.load(CONFIGS / "attention" / f"{variant}.yaml"))
    return out


def uptrain_config(cfg: DictConfig, out_dir: Path) -> DictConfig:
    """Convert the study's trained MHA model to the target variant by mean-pooling its K/V heads
    (Ainslie et al. 2023), and the config that uptrains it for study.uptrain_iters steps."""
    target = variant_config(cfg, cfg.study.uptrain_to)
    n_kv_head = OmegaConf.to_container(target.model, resolve=True)["n_kv_head"]
    converted = out_dir / f"mha_to_{cfg.study.uptrain_to}.pt"
    convert_checkpoint(out_dir / "mha", n_kv_head, converted)
    target.init_from = str(converted)
    target.train.max_iters = cfg.study.uptrain_iters
    target.train.lr = cfg.study.uptrain_lr
    target.train.warmup_iters = min(cfg.train.warmup_iters, cfg.study.uptrain_iters // 10)
    target.train.eval_interval = max(1, cfg.study.uptrain_iters // 4)
    return target


def decode_tokens_per_s(model: GPT, batch_size: int, device) -> float:
    """Cached greedy decode: prompt of block_size/2 tokens, then decode to block_size."""
    block = model.config.block_size
    prompt = torch.randint(0, model.config.vocab_size, (batch_size, max(1, block // 2)), device=device)
    n = block - prompt.size(1)
    timed_stream(model, prompt, n)  # warm-up
    _, decode_s = timed_stream(model, prompt, n)
    return batch_size * (n - 1) / decode_s


def measure(run_dir: Path, device, batch_sizes) -> dict:
    model, _ = load_model(run_dir / "best.pt", device)
    config = model.config
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    speeds = sorted(r["tokens_per_s"] for r in records if "tokens_per_s" in r)
    cache = model.new_kv_cache(1)
    return {
        "n_head": config.n_head, "n_kv_head": config.n_kv_head, "params": model.num_params(),
        "best_val": min(v for _, v in evals), "val_curve": evals,
        "kv_bytes_per_token": cache.bytes_per_token, "kv_mb_at_block": cache.nbytes / 2**20,
        "block_size": config.block_size,
        "decode": {b: decode_tokens_per_s(model, b, device) for b in batch_sizes},
        "train_tokens_per_s": speeds[len(speeds) // 2],
    }


def write_table(rows: dict, path: Path, batch_sizes) -> str:
    head = ("| variant | n_kv_head | params | best val | KV bytes/token | KV MB at block_size "
            f"(batch 1) | {' | '.join(f'decode tok/s, batch {b}' for b in batch_sizes)} | train tok/s |")
    lines = [head, "|" + " --- |" * (7 + len(batch_sizes))]
    for name, r in rows.items():
        decode = " | ".join(f"{r['decode'][b]:,.0f}" for b in batch_sizes)
        lines.append(f"| {name} | {r['n_kv_head']} | {r['params']:,} | {r['best_val']:.4f} | "
                     f"{r['kv_bytes_per_token']:,} | {r['kv_mb_at_block']:.3f} | {decode} | "
                     f"{r['train_tokens_per_s']:,.0f} |")
    table = "\n".join(lines) + "\n"
    path.write_text(table)
    return table


def plot(rows: dict, out_dir: Path, batch_sizes) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in rows.items():
        ax.plot(*zip(*r["val_curve"]), marker="o", label=name)
    ax.set(xlabel="step", ylabel="val loss", title="Validation loss")
    ax.legend()
    save_figure(fig, out_dir / "val_loss.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, r in rows.items():
        ax.scatter(r["kv_bytes_per_token"], r["best_val"], s=60)
        ax.annotate(name, (r["kv_bytes_per_token"], r["best_val"]), xytext=(5, 5), textcoords="offset points")
    ax.set(xlabel="KV cache bytes per token", ylabel="best val loss", title="Loss vs KV cache size")
    save_figure(fig, out_dir / "val_vs_kv_bytes.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / len(rows)
    for i, (name, r) in enumerate(rows.items()):
        ax.bar([j + i * width for j in range(len(batch_sizes))], [r["decode"][b] for b in batch_sizes],
               width, label=name)
    ax.set_xticks([j + width * (len(rows) - 1) / 2 for j in range(len(batch_sizes))],
                  [f"batch {b}" for b in batch_sizes])
    ax.set(ylabel="decode tokens/s (KV cache)", title="Decode speed by batch size")
    ax.legend()
    save_figure(fig, out_dir / "decode_by_batch.png", grid_axis="y")


def run_study(cfg: DictConfig, out_dir: Path) -> dict:
    """Train every variant into out_dir/<variant>, measure them, write study.md and the plots."""
    out_dir = Path(out_dir)
    config_object(cfg.study, "study.")  # checks the study's options before anything trains
    device = pick_device(cfg.train.device, "train.device")
    batch_sizes = list(cfg.study.decode_batch_sizes)
    rows = {}
    for variant in cfg.study.variants:
        print(f"=== training {variant} ===", flush=True)
        train(variant_config(cfg, variant), out_dir / variant)
        rows[variant] = measure(out_dir / variant, device, batch_sizes)
    if cfg.study.uptrain_iters and "mha" in rows:
        name = f"{cfg.study.uptrain_to} uptrained from mha ({cfg.study.uptrain_iters} steps)"
        print(f"=== {name} ===", flush=True)
        train(uptrain_config(cfg, out_dir), out_dir / "uptrained")
        rows[name] = measure(out_dir / "uptrained", device, batch_sizes)
    table = write_table(rows, out_dir / "study.md", batch_sizes)
    (out_dir / "study.json").write_text(json.dumps(rows, indent=1))
    plot(rows, out_dir, batch_sizes)
    print(table + f"\nwritten to {out_dir}: study.md, study.json, val_loss.png, val_vs_kv_bytes.png, "
          f"decode_by_batch.png")
    return rows


@hydra.main(config_path="../configs", config_name="study", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run_guarded(run_study, cfg, HydraConfig.get().runtime.output_dir)


if __name__ == "__main__":
    check_command_line(Path(__file__).parents[1] / "configs", "study", sys.argv[1:])
    main()
