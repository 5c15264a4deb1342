"""Train a GPT on TinyShakespeare (or your own text) with Hydra configs.

    python train.py                                   # the main job: a recipe picked for this machine
    python train.py experiment=shakespeare_char attention=gqa
    python train.py -m attention=mha,gqa,mqa          # a sweep, in multirun/
    torchrun --nproc_per_node=2 train.py ...          # DDP (NCCL on GPU, gloo on CPU)

`train(cfg, run_dir)` is the whole loop, callable from Python; `main` is the Hydra wrapper.
"""

import dataclasses
import json
import logging
import math
import os
import random
import signal
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

import hydra
import numpy as np
import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from data.batches import Batches
from data.prepare import load_prepared, prepare
from data.tokenizer import DataError, tokenizer_from_meta
from model import GPT, GPTConfig


class RunError(Exception):
    """A run that cannot start or go on (bad checkpoint, mismatched config, NaN loss): one line."""


# ----------------------------------------------------------------------------- devices and setup

def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RunError(f"train.device={name} but CUDA is not available")
    return torch.device(name)


def autocast_for(device: torch.device, dtype: str):
    """bf16 autocast on CUDA by default; float32 (no autocast) on CPU."""
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    if dtype == "float32":
        return nullcontext()
    if dtype != "bfloat16":
        raise RunError(f"train.dtype={dtype!r} is not one of auto, float32, bfloat16")
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def model_config(cfg_model, vocab_size: int) -> GPTConfig:
    fields = OmegaConf.to_container(cfg_model, resolve=True)
    fields["vocab_size"] = fields.get("vocab_size") or vocab_size
    return GPTConfig(**fields)


def configure_optimizer(model: GPT, tcfg, device: torch.device) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only (not on biases and norm weights)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": tcfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=tcfg.lr, betas=(tcfg.beta1, tcfg.beta2),
                             fused=device.type == "cuda")


def lr_at(step: int, tcfg) -> float:
    """Linear warmup to lr, then cosine decay to min_lr at lr_decay_iters, then min_lr."""
    if step < tcfg.warmup_iters:
        return tcfg.lr * (step + 1) / (tcfg.warmup_iters + 1)
    if step >= tcfg.lr_decay_iters:
        return tcfg.min_lr
    progress = (step - tcfg.warmup_iters) / max(1, tcfg.lr_decay_iters - tcfg.warmup_iters)
    return tcfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (tcfg.lr - tcfg.min_lr)


def flops_per_token(config: GPTConfig, n_params: int) -> float:
    """Training FLOPs per token: 6 per parameter plus attention's 12·n_layer·n_embd·block_size."""
    return 6 * n_params + 12 * config.n_layer * config.n_embd * config.block_size


# ----------------------------------------------------------------------------- checkpoints

def checkpoint_file(path, prefer: str = "ckpt.pt") -> Path:
    """A checkpoint file, or the one in a run dir: `prefer` (ckpt.pt, the last, to resume;
    best.pt to sample), else the other."""
    path = Path(path).expanduser()
    if path.is_dir():
        for name in (prefer, ({"ckpt.pt", "best.pt"} - {prefer}).pop()):
            if (path / name).is_file():
                return path / name
        raise RunError(f"no checkpoint (ckpt.pt or best.pt) in {path}")
    if not path.is_file():
        raise RunError(f"checkpoint not found: {path}")
    return path


def load_checkpoint(path) -> dict:
    """Tensors and plain data only: weights_only=True never unpickles arbitrary objects."""
    path = checkpoint_file(path)
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
        GPTConfig(**ckpt["model_config"])
    except Exception as e:
        raise RunError(f"cannot read checkpoint {path}: {type(e).__name__}: "
                       f"{str(e).splitlines()[0][:200] if str(e) else ''}") from None
    return ckpt


def unwrap(model) -> GPT:
    """The plain GPT inside DDP and torch.compile wrappers."""
    model = getattr(model, "module", model)
    return getattr(model, "_orig_mod", model)


def load_weights(model, state_dict: dict) -> None:
    """Load weights into a GPT, compiled or not, from a checkpoint of either."""
    state_dict = {k.removeprefix("_orig_mod."): v for k, v in state_dict.items()}
    unwrap(model).load_state_dict(state_dict)


def save_checkpoint(path: Path, state: dict) -> None:
    """Atomic: write a temp file in the same folder, then rename it over the old one."""
    with tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.", delete=False) as f:
        torch.save(state, f)
    os.replace(f.name, path)


def rng_state(batches: Batches) -> dict:
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "python": random.getstate(),
        "batches": batches.state_dict(),
    }


def restore_rng(state: dict, batches: Batches) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(state["python"])
    batches.load_state_dict(state["batches"])


def check_same_model(saved: dict, wanted: GPTConfig, path) -> None:
    for field, value in dataclasses.asdict(wanted).items():
        if field != "dropout" and saved.get(field) != value:
            raise RunError(f"checkpoint {path} has model.{field}={saved.get(field)!r} but this run "
                           f"asks for {value!r}: resume with the checkpoint's model settings")


# ----------------------------------------------------------------------------- evaluation and output

@torch.no_grad()
def estimate_loss(model, splits: dict, iters: int, seed: int, amp) -> dict:
    """Mean loss over `iters` batches per split, the same batches at every evaluation."""
    model.eval()
    out = {}
    for name, batches in splits.items():
        saved = batches.state_dict()
        batches.generator.manual_seed(seed)
        losses = torch.zeros(iters)
        for i in range(iters):
            x, y = batches.next()
            with amp:
                losses[i] = model(x, y)[1].item()
        batches.load_state_dict(saved)
        out[name] = losses.mean().item()
    model.train()
    return out


def plot_losses(metrics_path: Path, png_path: Path) -> None:
    import matplotlib

    logging.getLogger("matplotlib").setLevel(logging.WARNING)  # Hydra sets INFO for all loggers
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    fig, ax = plt.subplots(figsize=(6, 4))
    steps = [(r["step"], r["loss"]) for r in records if "loss" in r]
    if steps:
        ax.plot(*zip(*steps), alpha=0.4, label="train (batch)")
    for key in ("train_loss", "val_loss"):
        points = [(r["step"], r[key]) for r in records if key in r]
        if points:
            ax.plot(*zip(*points), marker="o", label=key.replace("_", " "))
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


class StopRequest:
    """Turns SIGINT and SIGTERM into a flag the loop checks after each step, so an interrupted
    run saves a checkpoint and exits cleanly instead of dying mid-write."""

    def __init__(self):
        self.signum = None
        self.previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self.previous[sig] = signal.signal(sig, self.handle)
        return self

    def handle(self, signum, frame):
        self.signum = signum

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


# ----------------------------------------------------------------------------- the loop

def train(cfg: DictConfig, run_dir: Path) -> dict:
    """Train as `cfg` says, writing metrics, checkpoints and a loss plot to run_dir."""
    tcfg = cfg.train
    run_dir = Path(run_dir)
    ddp = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    rank, world_size = (int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])) if ddp else (0, 1)
    device = pick_device(tcfg.device)
    if ddp:
        if device.type == "cuda":
            device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}")
            torch.cuda.set_device(device)
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    master = rank == 0
    try:
        return _train(cfg, tcfg, run_dir, device, rank, world_size, master)
    finally:
        if ddp:
            dist.destroy_process_group()


def _train(cfg, tcfg, run_dir, device, rank, world_size, master) -> dict:
    def log(msg):
        if master:
            tqdm.write(msg)

    torch.manual_seed(tcfg.seed)
    random.seed(tcfg.seed)
    np.random.seed(tcfg.seed)
    amp = autocast_for(device, tcfg.dtype)

    # Data: rank 0 prepares while the other ranks wait, then they find it prepared.
    if world_size > 1 and not master:
        dist.barrier()
    prepared = prepare(cfg.data)
    if world_size > 1 and master:
        dist.barrier()
    meta, train_tokens, val_tokens = load_prepared(prepared)

    # Model: from the config, or the architecture of an init_from / resume checkpoint.
    resume = load_checkpoint(tcfg.resume) if tcfg.resume else None
    config = model_config(cfg.model, meta["vocab_size"])
    init_state = None
    if cfg.get("init_from"):
        from_config, init_state = init_weights_from(cfg.init_from)
        config = dataclasses.replace(from_config, dropout=config.dropout)
        log(f"init_from {cfg.init_from}: its architecture, dropout={config.dropout}")
    if config.vocab_size < meta["vocab_size"]:
        raise RunError(f"model.vocab_size={config.vocab_size} is smaller than the data's "
                       f"vocabulary ({meta['vocab_size']})")
    if resume is not None:
        check_same_model(resume["model_config"], config, tcfg.resume)
    model = GPT(config).to(device)
    if init_state is not None:
        load_weights(model, init_state)
    optimizer = configure_optimizer(model, tcfg, device)

    # Every rank draws the same global batch and takes its slice, so N processes see exactly
    # the batches one process would with N times the batch size.
    global_batch = tcfg.batch_size * world_size
    train_batches = Batches(train_tokens, config.block_size, global_batch, device=device,
                            seed=tcfg.seed, on_device=cfg.data.on_device)
    eval_splits = {name: Batches(tokens, config.block_size, global_batch, device=device,
                                 seed=tcfg.seed, on_device=cfg.data.on_device)
                   for name, tokens in (("train", train_tokens), ("val", val_tokens))}

    step, best_val = 0, float("inf")
    if resume is not None:
        load_weights(model, resume["model"])
        optimizer.load_state_dict(resume["optimizer"])
        step, best_val = resume["step"], resume["best_val"]
        restore_rng(resume["rng"], train_batches)
        log(f"resumed from {tcfg.resume} at step {step} (best val {best_val:.4f})")

    compile_on = device.type == "cuda" if tcfg.compile == "auto" else bool(tcfg.compile)
    if compile_on:
        model = torch.compile(model)
    if world_size > 1:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    raw_model = unwrap(model)

    n_params = raw_model.num_params()
    tokens_per_step = global_batch * tcfg.grad_accum * config.block_size
    log(f"model: {n_params / 1e6:.2f}M parameters, n_layer={config.n_layer} n_head={config.n_head} "
        f"n_kv_head={config.n_kv_head} n_embd={config.n_embd} block_size={config.block_size} | "
        f"data: {meta['tokenizer']} vocab {meta['vocab_size']}, {len(train_tokens):,} train tokens | "
        f"{tokens_per_step:,} tokens/step on {world_size} x {device} | run dir: {run_dir}")

    import wandb

    resolved_cfg = OmegaConf.to_container(cfg, resolve=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    run = wandb.init(mode=cfg.wandb.mode if master else "disabled", project=cfg.wandb.project,
                     name=cfg.wandb.name, dir=str(run_dir), config=resolved_cfg)
    metrics_path = run_dir / "metrics.jsonl"

    def record(entry: dict):
        entry["elapsed_s"] = time.perf_counter() - start_time  # time to a loss, evals included
        if master:
            with metrics_path.open("a") as f:
                f.write(json.dumps(entry) + "\n")
            run.log({k: v for k, v in entry.items() if k != "step"}, step=entry["step"])

    def checkpoint(name: str):
        state = {
            "model": raw_model.state_dict(),
            "model_config": dataclasses.asdict(config),
            "optimizer": optimizer.state_dict(),
            "step": step,
            "best_val": best_val,
            "rng": rng_state(train_batches),
            "config": resolved_cfg,
            "data_meta": meta,
        }
        if master:
            save_checkpoint(run_dir / name, state)
        return run_dir / name

    peak_flops = tcfg.get("peak_tflops", 989) * 1e12  # H100 SXM dense bf16
    progress = tqdm(total=tcfg.max_iters, initial=step, disable=not (master and sys.stderr.isatty()),
                    dynamic_ncols=True, desc="train")
    lo, hi = rank * tcfg.batch_size, (rank + 1) * tcfg.batch_size
    stop = StopRequest()
    start_time = time.perf_counter()
    last_ckpt = None
    with stop:
        t0, tokens_since = time.perf_counter(), 0
        while step < tcfg.max_iters:
            if step % tcfg.eval_interval == 0 and master:
                losses = estimate_loss(raw_model, eval_splits, tcfg.eval_iters, tcfg.seed, amp)
                record({"step": step, "train_loss": losses["train"], "val_loss": losses["val"]})
                log(f"step {step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
                if not math.isfinite(losses["val"]):
                    where = f"; the last good checkpoint is {last_ckpt}" if last_ckpt else ""
                    raise RunError(f"val loss is {losses['val']} at step {step}: stopped{where}")
                if step > 0:
                    if losses["val"] < best_val:
                        best_val = losses["val"]
                        checkpoint("best.pt")
                    last_ckpt = checkpoint("ckpt.pt")
                t0, tokens_since = time.perf_counter(), 0

            lr = lr_at(step, tcfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            for micro in range(tcfg.grad_accum):
                x, y = train_batches.next()
                x, y = x[lo:hi], y[lo:hi]
                sync = micro == tcfg.grad_accum - 1
                with model.no_sync() if world_size > 1 and not sync else nullcontext(), amp:
                    _, loss = model(x, y)
                (loss / tcfg.grad_accum).backward()
            if tcfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            tokens_since += tokens_per_step

            if step % tcfg.log_interval == 0 or step == tcfg.max_iters:
                loss_value = loss.detach()
                if world_size > 1:
                    dist.all_reduce(loss_value)
                    loss_value /= world_size
                loss_value = loss_value.item()
                if not math.isfinite(loss_value):
                    where = f"; the last good checkpoint is {last_ckpt}" if last_ckpt else ""
                    raise RunError(f"loss is {loss_value} at step {step}: stopped{where}")
                elapsed = time.perf_counter() - t0
                entry = {"step": step, "loss": loss_value, "lr": lr,
                         "tokens_per_s": tokens_since / elapsed}
                if device.type == "cuda":
                    entry["mfu"] = flops_per_token(config, n_params) * entry["tokens_per_s"] / peak_flops
                record(entry)
                progress.set_postfix(loss=f"{loss_value:.4f}", lr=f"{lr:.2e}",
                                     tok_s=f"{entry['tokens_per_s']:,.0f}")
                if master and progress.disable:  # not a terminal: plain log lines
                    print(f"step {step}/{tcfg.max_iters}: loss {loss_value:.4f}, lr {lr:.2e}, "
                          f"{entry['tokens_per_s']:,.0f} tokens/s", flush=True)
            progress.update(1)

            if stop.signum is not None:
                path = checkpoint("ckpt.pt")
                progress.close()
                run.finish()
                name = signal.Signals(stop.signum).name
                log(f"{name}: saved {path} at step {step}; continue with train.resume={run_dir}")
                return {"interrupted": stop.signum, "step": step, "checkpoint": path}
    progress.close()

    losses = estimate_loss(raw_model, eval_splits, tcfg.eval_iters, tcfg.seed, amp) if master else {}
    if master:
        record({"step": step, "train_loss": losses["train"], "val_loss": losses["val"]})
        log(f"step {step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if losses["val"] < best_val:
            best_val = losses["val"]
            checkpoint("best.pt")
    last_ckpt = checkpoint("ckpt.pt")
    run.finish()
    summary = {"step": step, "best_val": best_val, "checkpoint": run_dir / "best.pt",
               "run_dir": run_dir}
    if master:
        plot_losses(metrics_path, run_dir / "loss.png")
        if tcfg.sample_tokens > 0:
            tokenizer = tokenizer_from_meta(meta, cfg.data.get("bpe_path"))
            prompt = torch.tensor([tokenizer.encode("\n")], device=device)
            g = torch.Generator(device=device).manual_seed(tcfg.seed)
            out = raw_model.eval().generate(prompt, tcfg.sample_tokens, temperature=0.8, top_k=200,
                                            generator=g)
            log(f"--- sample ---{tokenizer.decode(out[0].tolist())}\n--- end of sample ---")
        log(f"best val loss {best_val:.4f}; checkpoint: {summary['checkpoint']}")
    return summary


def init_weights_from(path) -> tuple[GPTConfig, dict]:
    """Architecture and weights to start from: a Hugging Face GPT-2 directory or one of our
    checkpoints (a converted one too)."""
    path = Path(path).expanduser()
    if (path / "config.json").is_file():
        model = GPT.from_pretrained(path)
        return model.config, model.state_dict()
    ckpt = load_checkpoint(checkpoint_file(path, prefer="best.pt"))
    return GPTConfig(**ckpt["model_config"]), ckpt["model"]


# ----------------------------------------------------------------------------- command line

AUTO_RECIPES = {
    True: ("shakespeare_char", "CUDA is available: nanoGPT's GPU recipe"),
    False: ("shakespeare_char_cpu_fast", "no CUDA device: the CPU recipe, about a minute on 2 cores"),
}


def with_default_experiment(argv: list[str]) -> list[str]:
    """Without experiment=..., pick the recipe for this machine and say so."""
    if any(a.lstrip("+").startswith("experiment=") for a in argv[1:]):
        return argv
    recipe, why = AUTO_RECIPES[torch.cuda.is_available()]
    print(f"recipe: experiment={recipe} ({why}); choose another with experiment=...", flush=True)
    return [*argv, f"experiment={recipe}"]


def exit_on_user_error(fn, *args):
    """Run fn; a problem with the user's input or setup ends the process with one line, exit 1."""
    try:
        return fn(*args)
    except (DataError, RunError, ValueError) as e:
        sys.exit(f"error: {e}")


def hydra_run_dir() -> Path:
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


@hydra.main(config_path="configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    exit_on_user_error(train, cfg, hydra_run_dir())


if __name__ == "__main__":
    sys.argv = with_default_experiment(sys.argv)
    main()
