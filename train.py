"""Train a GPT on TinyShakespeare (or your own text) with Hydra configs.

    python train.py                                   # the main job: a recipe picked for this machine
    python train.py experiment=shakespeare_char attention=gqa
    python train.py -m attention=mha,gqa,mqa          # a sweep, in multirun/
    torchrun --nproc_per_node=2 train.py ...          # DDP (NCCL on GPU, gloo on CPU)

In nanoGPT's order: the `train` group's schema, setup (processes, device, seeds), the data, the
model and its optimizer, evaluation and logging, then `train(cfg, run_dir)`: the loop, callable
from Python. `main` is the Hydra wrapper.
"""

import os
import signal
import sys

if __name__ == "__main__" and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(130))  # Ctrl-C while importing: quiet

import dataclasses
import json
import math
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import hydra
import torch
import torch.distributed as dist
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from data.batches import Batches
from data.errors import check_command_line, check_keys, config_object, one_line, run_guarded
from data.prepare import DataConfig, corpus_files, load_prepared, prepare
from data.tokenizer import describe_tokenizer, same_tokenizer, tokenizer_from_meta
from model import GPT, GPTConfig, checkpoint
from model.checkpoint import Checkpoint
from model.device import autocast, check_device, init_distributed, main_process_first
from model.evaluation import estimate_loss, split_loss
from model.optimizer import check_optimizer, configure_optimizer, load_optimizer_state
from model.plots import plot_losses


@dataclass
class TrainConfig:
    """The `train` group (configs/train/default.yaml): optimizer, schedule and loop settings."""

    seed: int = 1337
    device: str = "auto"          # auto | cpu | cuda | cuda:N
    dtype: str = "auto"           # auto (bf16 autocast on CUDA, float32 on CPU) | float32 | bfloat16
    compile: Any = "auto"         # auto (on for CUDA) | true | false
    batch_size: int = 12          # sequences per micro-step and process
    grad_accum: int = 1           # micro-steps per optimizer step
    max_iters: int = 2000
    optimizer: str = "adamw"      # adamw | muon (Muon on the blocks' matrices, AdamW on the rest)
    lr: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 100
    lr_decay_iters: int = 2000    # the cosine reaches min_lr here
    weight_decay: float = 0.1     # matrices only
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0        # 0 disables
    eval_interval: int = 250
    eval_iters: int = 20          # batches per split at each evaluation
    full_val: bool = True         # at the end, the loss over every token of the val split
    log_interval: int = 10
    sample_tokens: int = 300      # the sample printed at the end
    resume: str | None = None     # a run dir or checkpoint file to continue
    peak_tflops: float = 989.0    # the device's bf16 peak, for MFU (H100 SXM dense)

    def __post_init__(self):
        rules = {">= 1": (lambda v: v >= 1, "batch_size grad_accum eval_interval eval_iters log_interval"),
                 ">= 0": (lambda v: v >= 0, "max_iters warmup_iters lr_decay_iters min_lr weight_decay "
                                            "grad_clip sample_tokens"),
                 "> 0": (lambda v: v > 0, "lr peak_tflops"),
                 "in [0, 1)": (lambda v: 0 <= v < 1, "beta1 beta2"),
                 "one of auto, float32, bfloat16": (lambda v: v in ("auto", "float32", "bfloat16"), "dtype"),
                 "one of auto, true, false": (lambda v: v == "auto" or isinstance(v, bool), "compile")}
        for rule, (holds, names) in rules.items():
            for name in names.split():
                if not holds(getattr(self, name)):
                    raise ValueError(f"train.{name} must be {rule}, got {getattr(self, name)!r}")
        if self.min_lr > self.lr:
            raise ValueError(f"train.min_lr={self.min_lr} must not exceed train.lr={self.lr}")
        check_device(self.device, "train.device")
        check_optimizer(self.optimizer)


ConfigStore.instance().store(group="train", name="schema", node=TrainConfig)
ConfigStore.instance().store(group="model", name="schema", node=GPTConfig)  # configs/model/base.yaml


# ----------------------------------------------------------------------------- setup

def say(msg: str) -> None:
    """Print from rank 0 only (every rank runs this file under torchrun)."""
    if int(os.environ.get("RANK", 0)) == 0:
        tqdm.write(msg)


# ----------------------------------------------------------------------------- model and optimizer

def model_config(cfg_model, vocab_size: int) -> GPTConfig:
    """The `model` group as a GPTConfig (the data's vocab_size unless model.vocab_size is set);
    its errors name the option as the user typed it, model.<field>."""
    fields = OmegaConf.to_container(cfg_model, resolve=True)
    check_keys(fields, GPTConfig, "model.")
    try:
        return GPTConfig(**fields | {"vocab_size": fields.get("vocab_size") or vocab_size})
    except ValueError as e:
        raise ValueError(str(e).replace("GPTConfig.", "model.")) from e


def build_model(cfg: DictConfig, meta: dict, resume: Checkpoint | None) -> GPT:
    """The GPT the config describes, for the data's tokenizer (`meta`); with a resumed checkpoint,
    its weights (the model may not change); else with init_from the source's architecture and
    weights (only model.dropout from the config). Either must have been trained with meta's tokenizer."""
    config = model_config(cfg.model, meta["vocab_size"])
    source, option = resume, f"train.resume={cfg.train.resume}"
    if resume is None and cfg.init_from:
        source, option = checkpoint.init_from(cfg.init_from), f"init_from={cfg.init_from}"
    if source is not None and not same_tokenizer(source.data_meta, meta):
        raise ValueError(f"{option} was trained with {describe_tokenizer(source.data_meta)}, but this data "
                         f"has {describe_tokenizer(meta)}: its token ids would mean other text")
    if resume is not None:
        checkpoint.check_resumable(resume, config, option)
    elif source is not None:
        config = dataclasses.replace(source.model_config, dropout=config.dropout)
        say(f"init_from {cfg.init_from}: its architecture, dropout={config.dropout}")
    if config.vocab_size < meta["vocab_size"]:
        raise ValueError(f"model.vocab_size={config.vocab_size} is smaller than the data's "
                         f"vocabulary ({meta['vocab_size']})")
    model = GPT(config)
    if source is not None:
        checkpoint.load_weights(model, source.model, option)
    return model


def lr_at(step: int, tcfg: TrainConfig) -> float:
    """Linear warmup to lr, then cosine decay to min_lr at lr_decay_iters, then min_lr."""
    if step < tcfg.warmup_iters:
        return tcfg.lr * (step + 1) / (tcfg.warmup_iters + 1)
    if step >= tcfg.lr_decay_iters:
        return tcfg.min_lr
    progress = (step - tcfg.warmup_iters) / max(1, tcfg.lr_decay_iters - tcfg.warmup_iters)
    return tcfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (tcfg.lr - tcfg.min_lr)


# ----------------------------------------------------------------------------- evaluation and output

@dataclass
class Run:
    """What the loop advances and a checkpoint saves."""

    model: GPT                    # the plain model, not its compiled or DDP wrapper
    optimizer: torch.optim.Optimizer
    batches: Batches              # the training batches, whose RNG state is saved
    run_dir: Path
    resolved_cfg: dict
    data_meta: dict
    master: bool
    step: int = 0
    best_val: float = math.inf
    last_saved: Path | None = None

    def save(self, name: str) -> Path:
        """Write run_dir/name (rank 0 only)."""
        path = self.run_dir / name
        if self.master:
            checkpoint.save(path, Checkpoint(
                model=self.model.state_dict(), model_config=self.model.config, data_meta=self.data_meta,
                config=self.resolved_cfg, step=self.step, best_val=self.best_val,
                optimizer=self.optimizer.state_dict(),
                rng={**checkpoint.rng_state(), "batches": self.batches.state_dict()}))
        return path

    def evaluate(self, splits: dict, tcfg: "TrainConfig", amp, log: "RunLog") -> None:
        """Evaluate on the fixed batches and record it; then save best.pt if val improved, and
        ckpt.pt (except at the first step of a run that goes on)."""
        losses = estimate_loss(self.model, splits, tcfg.eval_iters, tcfg.seed, amp)
        log.record({"step": self.step, "train_loss": losses["train"], "val_loss": losses["val"]})
        say(f"step {self.step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if not math.isfinite(losses["val"]):
            raise self.diverged("val loss", losses["val"])
        if self.step > 0 or self.step == tcfg.max_iters:
            if losses["val"] < self.best_val:
                self.best_val = losses["val"]
                self.save("best.pt")
            self.last_saved = self.save("ckpt.pt")

    def diverged(self, what: str, value: float) -> FloatingPointError:
        kept = f"; the last good checkpoint is {self.last_saved}" if self.last_saved else ""
        return FloatingPointError(f"{what} is {value} at step {self.step}: stopped{kept}")


class RunLog:
    """Where a run's progress goes: metrics.jsonl, wandb when wandb.mode is not disabled, and the
    terminal (a tqdm bar, or plain lines when stderr is not one). Each record is stamped with the
    seconds since the loop started, evaluations included."""

    def __init__(self, run_dir: Path, wandb_run, master: bool, step: int, max_iters: int):
        self.path, self.master, self.max_iters = run_dir / checkpoint.METRICS_FILE, master, max_iters
        self.wandb = wandb_run
        self.bar = tqdm(total=max_iters, initial=step, desc="train", dynamic_ncols=True,
                        disable=not (master and sys.stderr.isatty()))
        self.start = time.perf_counter()

    def record(self, entry: dict) -> None:
        entry["elapsed_s"] = time.perf_counter() - self.start
        if self.master:
            try:
                with self.path.open("a") as f:
                    f.write(json.dumps(entry) + "\n")
            except OSError as e:
                raise type(e)(f"cannot write {self.path}: {e.strerror or e}") from e
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in entry.items() if k != "step"}, step=entry["step"])

    def training_step(self, step: int, loss: float, lr: float, tokens_per_s: float, mfu=None) -> None:
        self.record({"step": step, "loss": loss, "lr": lr, "tokens_per_s": tokens_per_s}
                    | ({"mfu": mfu} if mfu is not None else {}))
        self.bar.set_postfix(loss=f"{loss:.4f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_s:,.0f}")
        if self.master and self.bar.disable:
            print(f"step {step}/{self.max_iters}: loss {loss:.4f}, lr {lr:.2e}, "
                  f"{tokens_per_s:,.0f} tokens/s", flush=True)

    def close(self) -> None:
        self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()


WANDB_MODES = ("disabled", "offline", "online")


def start_wandb(wandb_cfg, run_dir: Path, config: dict):
    """The wandb run (None when wandb.mode is disabled), started before any work so that a missing
    API key or a bad setting stops the run at once."""
    if wandb_cfg.mode == "disabled":
        return None
    import wandb  # seconds to import, and not on every machine: only when asked for

    try:
        return wandb.init(mode=wandb_cfg.mode, project=wandb_cfg.project, name=wandb_cfg.name,
                          dir=str(run_dir), config=config)
    except wandb.errors.Error as e:
        fix = "; or log locally with wandb.mode=offline" if wandb_cfg.mode == "online" else ""
        raise ValueError(f"wandb.mode={wandb_cfg.mode}: {one_line(e)}{fix}") from e


def print_sample(model: GPT, meta: dict, n_tokens: int, seed: int) -> None:
    tokenizer = tokenizer_from_meta(meta)
    device = model.wte.weight.device
    prompt = torch.tensor([tokenizer.encode("\n")], device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    out = model.eval().generate(prompt, n_tokens, temperature=0.8, top_k=200, generator=g,
                                vocab_size=tokenizer.vocab_size)
    say(f"--- sample ---{tokenizer.decode(out[0].tolist())}\n--- end of sample ---")


@contextmanager
def stop_requests():
    """Yields a list that SIGINT and SIGTERM append to, which the loop checks after each step:
    an interrupted run saves a checkpoint and exits cleanly instead of dying mid-write. A second
    signal (a step that takes too long) stops at once, without saving."""
    received = []

    def request(signum, frame):
        if received:
            raise KeyboardInterrupt
        received.append(signum)
        if int(os.environ.get("RANK", 0)) == 0:  # os.write: print() may be mid-write, not reentrant
            os.write(2, f"\n{signal.Signals(signum).name}: stopping after this step to save (again: "
                        f"stop now, unsaved)\n".encode())

    signals = [signal.SIGTERM] + [signal.SIGINT] * (signal.getsignal(signal.SIGINT) is not signal.SIG_IGN)
    previous = {sig: signal.signal(sig, request) for sig in signals}  # an ignored SIGINT stays ignored
    try:
        yield received
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# ----------------------------------------------------------------------------- the loop

def train(cfg: DictConfig, run_dir, resume: Checkpoint | None = None) -> dict:
    """Train as `cfg` says, writing metrics, checkpoints and a loss plot to run_dir, which must
    not hold another run (see checkpoint.claim_run_dir). Every option is checked, and a resumed
    checkpoint read (unless the caller has, `resume`), before any work starts."""
    tcfg, dcfg = config_object(cfg.train, "train."), config_object(cfg.data, "data.")
    model_config(cfg.model, vocab_size=1)  # the model options' ranges, checked before any work
    if cfg.wandb.mode not in WANDB_MODES:
        raise ValueError(f"wandb.mode={cfg.wandb.mode!r} is not one of {', '.join(WANDB_MODES)}")
    corpus_files(dcfg)  # the corpus's files exist
    if tcfg.resume:
        resume = resume or checkpoint.load(tcfg.resume, option="train.resume")
        checkpoint.remove_stale_temp_files(checkpoint.find(tcfg.resume).parent)
        checkpoint.check_resumable(resume, model_config(cfg.model, resume.model_config.vocab_size),
                                   f"train.resume={tcfg.resume}")
        if resume.step > tcfg.max_iters:
            raise ValueError(f"train.max_iters={tcfg.max_iters} is below the step train.resume reached "
                             f"({resume.step}): set train.max_iters={resume.step} or more")
    elif cfg.init_from:
        checkpoint.check_init_from(cfg.init_from)
    resume = resume if tcfg.resume else None
    rank, world_size, device = init_distributed(tcfg.device)
    run_dir = checkpoint.claim_run_dir(run_dir) if rank == 0 else Path(run_dir)
    try:
        return fit(cfg, tcfg, dcfg, resume, run_dir, rank, world_size, device)
    finally:
        checkpoint.release_run_dir(run_dir)
        if dist.is_initialized():
            dist.destroy_process_group()


def fit(cfg, tcfg: TrainConfig, dcfg: DataConfig, resume: Checkpoint | None, run_dir: Path,
        rank, world_size, device) -> dict:
    master = rank == 0
    resolved_cfg = OmegaConf.to_container(cfg, resolve=True)
    wandb_run = start_wandb(cfg.wandb, run_dir, resolved_cfg) if master else None
    checkpoint.seed_rngs(tcfg.seed)
    amp = autocast(device, tcfg.dtype)
    with main_process_first():  # rank 0 prepares the data, the other ranks then find it
        meta, train_tokens, val_tokens = load_prepared(prepare(dcfg))

    raw_model = build_model(cfg, meta, resume).to(device)
    config, n_params = raw_model.config, raw_model.num_params()
    resolved_cfg["model"] = dataclasses.asdict(config)  # what was trained, init_from's included
    optimizer = configure_optimizer(raw_model, tcfg.optimizer, tcfg.lr, (tcfg.beta1, tcfg.beta2),
                                    tcfg.weight_decay, fused=device.type == "cuda")

    # Every rank draws the same global batch and takes its slice [lo:hi], so N processes see
    # exactly the batches one process would with N times the batch size.
    global_batch = tcfg.batch_size * world_size
    lo, hi = rank * tcfg.batch_size, (rank + 1) * tcfg.batch_size

    batches = partial(Batches, block_size=config.block_size, batch_size=global_batch, device=device,
                      seed=tcfg.seed, on_device=dcfg.on_device)
    eval_splits = {"train": batches(train_tokens, split="the train"),  # fixed evaluation batches
                   "val": batches(val_tokens, split="the val")}
    run = Run(raw_model, optimizer, batches(train_tokens), run_dir, resolved_cfg, meta, master)
    if resume is not None:
        load_optimizer_state(optimizer, resume.optimizer, tcfg.optimizer, f"train.resume={tcfg.resume}")
        run.step, run.best_val = resume.step, resume.best_val
        checkpoint.restore_rng(resume.rng)
        run.batches.load_state_dict(resume.rng["batches"])
        say(f"resumed from {tcfg.resume} at step {run.step} (best val {run.best_val:.4f})")

    model = raw_model
    if tcfg.compile is True or (tcfg.compile == "auto" and device.type == "cuda"):
        model = torch.compile(model)
    if world_size > 1:
        model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    tokens_per_step = global_batch * tcfg.grad_accum * config.block_size
    say(f"model: {n_params / 1e6:.2f}M parameters, n_layer={config.n_layer} n_head={config.n_head} "
        f"n_kv_head={config.n_kv_head} n_embd={config.n_embd} block_size={config.block_size}, "
        f"KV cache per token: {config.kv_cache_formula()} | "
        f"data: {meta['tokenizer']} vocab {meta['vocab_size']}, {len(train_tokens):,} train tokens | "
        f"{tokens_per_step:,} tokens/step on {world_size} x {device} | run dir: {run_dir}")

    log = RunLog(run_dir, wandb_run, master, run.step, tcfg.max_iters)
    t0, tokens_since = time.perf_counter(), 0
    with stop_requests() as stop:
        while True:
            if master and (run.step % tcfg.eval_interval == 0 or run.step == tcfg.max_iters):
                run.evaluate(eval_splits, tcfg, amp, log)
                t0, tokens_since = time.perf_counter(), 0  # throughput counts training only
            if run.step == tcfg.max_iters:
                break

            lr = lr_at(run.step, tcfg)
            for group in optimizer.param_groups:
                group["lr"] = lr
            for micro in range(tcfg.grad_accum):
                x, y = run.batches.next()
                last_micro = micro == tcfg.grad_accum - 1  # DDP syncs gradients only then
                with model.no_sync() if world_size > 1 and not last_micro else nullcontext(), amp:
                    _, loss = model(x[lo:hi], y[lo:hi])
                (loss / tcfg.grad_accum).backward()
            if tcfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), tcfg.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            run.step += 1
            tokens_since += tokens_per_step

            if run.step % tcfg.log_interval == 0 or run.step == tcfg.max_iters:
                loss = loss.detach()
                if world_size > 1:
                    dist.all_reduce(loss)
                    loss /= world_size
                if not math.isfinite(loss_value := loss.item()):
                    raise run.diverged("loss", loss_value)
                tokens_per_s = tokens_since / (time.perf_counter() - t0)
                mfu = (raw_model.flops_per_token() * tokens_per_s / (tcfg.peak_tflops * 1e12)
                       if device.type == "cuda" else None)
                log.training_step(run.step, loss_value, lr, tokens_per_s, mfu)
            log.bar.update(1)
            if world_size > 1:  # all ranks stop after the same step, or one would wait forever
                stopping = torch.tensor(float(bool(stop)), device=device)
                dist.all_reduce(stopping)
                if stopping.item() and not stop:
                    stop.append(signal.SIGTERM)
            if stop:
                break
    full_val = None
    if master and not stop and tcfg.full_val:
        full_val = split_loss(raw_model, torch.from_numpy(val_tokens.astype("int64")), amp)
        log.record({"step": run.step, "val_loss_full": full_val})
        say(f"step {run.step}: val loss {full_val:.4f} over the whole val split ({len(val_tokens):,} tokens)")
    log.close()

    if stop:
        path = run.save("ckpt.pt")
        say(f"{signal.Signals(stop[0]).name}: saved {path} at step {run.step}; continue with: "
            f"python train.py train.resume={run_dir}")
        return {"interrupted": stop[0], "step": run.step, "checkpoint": path, "run_dir": run_dir}
    if master:
        plot_losses(run_dir, run_dir / "loss.png")
        if tcfg.sample_tokens > 0:
            print_sample(raw_model, meta, tcfg.sample_tokens, tcfg.seed)
        say(f"best val loss {run.best_val:.4f}; checkpoint: {run_dir / 'best.pt'}")
    return {"step": run.step, "best_val": run.best_val, "val_loss_full": full_val,
            "checkpoint": run_dir / "best.pt", "run_dir": run_dir}


# ----------------------------------------------------------------------------- command line

AUTO_RECIPES = {
    True: ("shakespeare_char", "CUDA is available: nanoGPT's GPU recipe"),
    False: ("shakespeare_char_cpu_fast", "no CUDA device: the CPU recipe, 1-3 minutes on 2 cores"),
}


def with_default_experiment(argv: list[str]) -> list[str]:
    """Without experiment=..., pick the recipe for this machine and say so (not when resuming:
    a resumed run continues with its own config)."""
    given = dict(a.lstrip("+").partition("=")[::2] for a in argv[1:])
    if "experiment" in given or given.get("train.resume") not in (None, "", "null"):
        return argv
    recipe, why = AUTO_RECIPES[torch.cuda.is_available()]
    print(f"recipe: experiment={recipe} ({why}); choose another with experiment=...", flush=True)
    return [*argv, f"experiment={recipe}"]


# What a resumed run takes from this machine, not from the checkpoint: where things are and run.
MACHINE_KEYS = ("data.cache_dir", "train.device", "train.compile", "wandb.mode")
ABSENT = object()


def resume_config(cfg: DictConfig, saved: dict, changed: set[str]) -> DictConfig:
    """The config a resumed run continues with: the one saved in its checkpoint, except the keys
    in `changed` (those the command line set) and MACHINE_KEYS, which keep cfg's values. A key the
    saved config lacks (an older checkpoint) keeps cfg's value too; a changed model is refused
    later, by name. Saved values are resolved: lr_decay_iters stays as saved unless typed."""
    cfg = cfg.copy()
    for key, value in flat(saved).items():
        if (key not in changed and key not in MACHINE_KEYS
                and OmegaConf.select(cfg, key, default=ABSENT) is not ABSENT):
            OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def flat(config: dict, prefix: str = "") -> dict:
    """{"a.b": leaf} for every leaf of a nested dict (lists are leaves)."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out |= flat(value, f"{prefix}{key}.")
        else:
            out[f"{prefix}{key}"] = value
    return out


def changed_on_command_line(cfg: DictConfig, overrides: list[str]) -> set[str]:
    """The config keys the overrides set: each key typed, and every key a group option sets (attention=mha
    its four keys, ~attention what mha set), composed over train.yaml's groups with none chosen."""
    changed, leaves, options = set(), flat(OmegaConf.to_container(cfg)), []
    primary = OmegaConf.load(Path(__file__).parent / "configs" / "train.yaml").defaults
    groups = {key: option for entry in primary if not isinstance(entry, str) for key, option in entry.items()}
    ConfigStore.instance().store(name="no_groups", node={"defaults": [
        entry if isinstance(entry, str) else dict.fromkeys(entry) for entry in primary]})
    for override in OverridesParser.create().parse_overrides(overrides):
        key = override.key_or_group
        if key not in groups:  # a value, or a node of values (wandb={mode: offline})
            changed |= {key} | {leaf for leaf in leaves if leaf.startswith(f"{key}.")}
        elif override.is_delete():  # ~attention: what its default set is unset
            options += [f"{key}={groups[key]}"] if groups[key] else []
        else:  # as typed: attention=mha, +attention@model=gqa, experiment=...
            options.append(override.input_line)
    alone = hydra.compose(config_name="no_groups", overrides=options)
    return changed | flat(OmegaConf.to_container(alone)).keys()


def command_line_train(cfg: DictConfig, run_dir: str, overrides: list[str]) -> dict:
    """train() as `python train.py` runs it, given the command line's overrides: with
    train.resume, on the checkpoint's own config plus what the command line set."""
    resume = None
    if cfg.train.resume:
        resume = checkpoint.load(cfg.train.resume, option="train.resume")
        changed = changed_on_command_line(cfg, overrides)
        cfg = resume_config(cfg, resume.config, changed)
        say(f"train.resume: the saved config of {cfg.train.resume}, changed here: "
            f"{', '.join(sorted(changed - {'train.resume'})) or 'nothing'}")
    return train(cfg, run_dir, resume)


class RunDirGuard(Callback):
    """Claims the run dir (checkpoint.claim_run_dir) before Hydra writes its .hydra/ there, so a
    run into a folder that holds another run, or one another process trains in, is refused
    before it changes anything. Rank 0 only: under torchrun the other ranks write nothing there
    (their .hydra/ and log file are turned off below)."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        if int(os.environ.get("RANK", 0)) == 0:
            try:
                checkpoint.claim_run_dir(config.hydra.run.dir)
            except (OSError, ValueError) as e:  # exit here: Hydra only warns about a callback's error
                sys.exit(f"error: {one_line(e)}")

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        """A sweep's jobs get their own run dirs; a sweep folder that already holds runs is refused
        (each job's claim would refuse too, but only after Hydra rewrote its .hydra/)."""
        sweep_dir = Path(config.hydra.sweep.dir)
        if found := next((p for name in checkpoint.RUN_MARKERS for p in sweep_dir.rglob(name)), None):
            sys.exit(f"error: hydra.sweep.dir={sweep_dir} already holds runs ({found}): write this sweep "
                     f"to another hydra.sweep.dir")


@hydra.main(config_path="configs", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> None:
    hydra_cfg = HydraConfig.get()
    result = run_guarded(command_line_train, cfg, hydra_cfg.runtime.output_dir, hydra_cfg.overrides.task)
    if result.get("interrupted"):
        sys.exit(128 + result["interrupted"])  # 130 for Ctrl-C, 143 for SIGTERM, as shells expect


if __name__ == "__main__":
    sys.argv = with_default_experiment(sys.argv)
    if int(os.environ.get("RANK", 0)) > 0:  # under torchrun only rank 0 writes to the run dir
        sys.argv += ["hydra.output_subdir=null", "hydra/job_logging=disabled"]
    check_command_line(Path(__file__).parent / "configs", "train", sys.argv[1:])
    main()
