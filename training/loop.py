"""The training loop, in nanoGPT's order: the model and optimizer (`build`), the loop (`train`), then
evaluate and save (`evaluate`, `finish`). `train(run, run_dir)` trains as a checked RunConfig says:

    from cli.options import check_options
    train(check_options(cfg), run_dir)      # cfg: train.yaml composed (tests/helpers.py's compose)
"""

import math
import signal
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from data.batches import Batches
from data.prepare import load_prepared
from data.tokenizer import start_ids, tokenizer_from_meta
from model import GPT, checkpoint
from training.distributed import init_distributed, mean_over_ranks, print0
from training.evaluation import estimate_loss, sample_ids, split_loss
from training.optimizer import configure_optimizer
from training.options import RunConfig, TrainConfig, out_of_memory
from training.plots import import_in_background, plot_losses
from training.rng import restore_rng, rng_states_of_ranks, seed_rngs
from training.run_dir import (
    LOSS_PLOT,
    MetricsLog,
    claim_run_dir,
    release_run_dir,
    remove_stale_temp_files,
    run_dir_write,
    stop_requests,
)
from training.saver import BackgroundSaver
from training.step import TrainStep, portable_state
from training.throughput import Throughput, autocast

# ----------------------------------------------------------------------------- model and optimizer

# Under torchrun, steps between the checks for a signal (each an all-reduce and a device sync): at
# most log_interval's, so that a run logging rarely still stops within seconds.
STOP_CHECK_STEPS = 10


@dataclass
class TrainingState:
    """What the loop advances and a checkpoint saves."""

    model: GPT                    # the plain model, not its compiled or DDP wrapper
    optimizer: torch.optim.Optimizer
    batches: Batches              # the training batches, whose RNG state is saved
    run: RunConfig
    run_dir: Path
    device: torch.device
    rank: int
    step: int = 0
    best_val: float = math.inf
    last_saved: Path | None = None
    saver: BackgroundSaver = field(default_factory=BackgroundSaver)  # checkpoints written while training

    def save(self, name: str, stopping: bool = False, also=()) -> Path | None:  # every rank calls it
        """Rank 0 starts writing the checkpoint `name` in the run dir, and the names in `also` as the
        same file (in the background: `saver.wait()` for it)."""
        if not (self.run.train.checkpoints or stopping):
            return None  # train.checkpoints=false: a timing run saves only when stopped by a signal
        path, processes = self.run_dir / name, rng_states_of_ranks(self.device)
        if self.rank == 0:
            self.saver.save(path, also=[self.run_dir / n for n in also], ckpt=checkpoint.Checkpoint(
                model=self.model.state_dict(), model_config=self.model.config, data_meta=self.run.meta,
                config=self.run.config, step=self.step, best_val=self.best_val,
                optimizer=portable_state(self.optimizer),
                rng={"processes": processes, "batches": self.batches.state_dict()}))
        return path

    def diverged(self, what: str, value: float) -> FloatingPointError:
        kept = f"; the last good checkpoint is {self.last_saved}" if self.last_saved else ""
        return FloatingPointError(f"{what} is {value} at step {self.step}: stopped{kept}")


def build(run: RunConfig, run_dir: Path, device, rank: int, world_size: int):
    """The model, optimizer and batches (resumed, or from init_from), and the model to step."""
    cfg, (_, train_tokens, val_tokens) = run.train, load_prepared(run.data_dir)
    seed_rngs(cfg.seed)
    model = GPT(run.model)  # the same initial weights on every rank
    if rank > 0:  # each rank its own dropout masks; rank 0 draws what a single process draws
        seed_rngs(cfg.seed + rank)
    if run.source is not None:
        model.load_state_dict(run.source.model)  # checked against its config by check_options
    model.to(device)
    optimizer = configure_optimizer(model, cfg.optimizer, cfg.lr, (cfg.beta1, cfg.beta2), cfg.weight_decay)
    # Every rank draws the same global batch and trains on its slice: N processes = one with N x the batch.
    batches = partial(Batches, block_size=run.model.block_size, batch_size=cfg.batch_size * world_size,
                      device=device, seed=cfg.seed, on_device=run.data.on_device)
    train_batches = batches(train_tokens)
    eval_batches = {"train": batches(train_batches.tokens), "val": batches(val_tokens)}  # same at every eval
    state = TrainingState(model, optimizer, train_batches, run, run_dir, device, rank)
    if cfg.resume:
        optimizer.load_state_dict(run.source.optimizer)
        state.step, state.best_val = run.source.step, run.source.best_val
        restore_rng(run.source.rng["processes"], rank, device)
        state.batches.load_state_dict(run.source.rng["batches"])
        print0(f"resumed from {cfg.resume} at step {state.step} (best val {state.best_val:.4f})")
    stepped = compiled_model(model, cfg.compile, device)  # what the training step runs
    if world_size > 1:
        stepped = DDP(stepped, device_ids=[device.index] if device.type == "cuda" else None)
    c = run.model
    print0(f"model: {model.num_params() / 1e6:.2f}M parameters, n_layer={c.n_layer} n_head={c.n_head} "
           f"n_kv_head={c.n_kv_head} n_embd={c.n_embd} block_size={c.block_size}, KV cache per token: "
           f"{c.kv_cache_formula()} | data: {run.meta['tokenizer']} vocab {run.meta['vocab_size']}, "
           f"{len(train_tokens):,} train tokens | {run.tokens_per_step(world_size):,} tokens/step on "
           f"{world_size} x {device} | run dir: {run_dir}")
    return state, stepped, eval_batches


def compiled_model(model: GPT, compile, device: torch.device) -> torch.nn.Module:
    """What the training step runs, as train.compile says: the model (false), the model compiled
    (true; auto on CUDA), or the model with each Block compiled (blocks): one graph that every layer
    reuses, so compiling costs one layer's time. Evaluations and the sample run the model eagerly
    (`eager`): no second graph to compile for eval mode, as nanochat does."""
    if compile == "blocks":
        for block in model.blocks:
            block.compile()
        return model
    return torch.compile(model) if compile is True or (compile == "auto" and device.type == "cuda") else model


def eager(state: "TrainingState"):
    """A context that runs the plain model eagerly, also where its blocks were compiled in place."""
    return torch.compiler.set_stance("force_eager") if state.run.train.compile == "blocks" else nullcontext()


def uses_cuda_graph(cfg: TrainConfig, device: torch.device, world_size: int) -> bool:
    """train.cuda_graph: true, or auto on CUDA for one process with AdamW (cli.options refuses the
    rest for true: DDP's hooks and Muon's Python-side step do not replay)."""
    return cfg.cuda_graph is True or (cfg.cuda_graph == "auto" and device.type == "cuda" and world_size == 1
                                      and cfg.optimizer == "adamw")


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to lr, then cosine decay to min_lr at lr_decay_iters, then min_lr."""
    if step < cfg.warmup_iters:
        return cfg.lr * (step + 1) / (cfg.warmup_iters + 1)
    if step >= cfg.lr_decay_iters:
        return cfg.min_lr
    progress = (step - cfg.warmup_iters) / max(1, cfg.lr_decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


# ----------------------------------------------------------------------------- the loop

def train(run: RunConfig, run_dir) -> dict:
    """Train as `run` says, writing metrics, checkpoints and a loss plot to run_dir, which must
    not hold another run. Ctrl-C or SIGTERM saves ckpt.pt and returns {"interrupted": signal}."""
    rank, world_size, device = init_distributed(run.device)
    cfg = run.train
    run_dir = claim_run_dir(run_dir) if rank == 0 else Path(run_dir)
    try:
        if rank == 0 and cfg.resume:
            remove_stale_temp_files(checkpoint.find(cfg.resume).parent)
        log = MetricsLog(run_dir, run.config, rank == 0, run.source.step if cfg.resume else 0, cfg.max_iters)
        state, model, eval_batches = build(run, run_dir, device, rank, world_size)
        amp, rows = autocast(device, cfg.dtype), slice(rank * cfg.batch_size, (rank + 1) * cfg.batch_size)
        step = TrainStep(state.model, model, state.optimizer, state.batches, cfg, amp, rows,
                         uses_cuda_graph(cfg, device, world_size), world_size)
        speed = Throughput(run.tokens_per_step(world_size), device, state.model.flops_per_token(), world_size,
                           cfg.peak_tflops and cfg.peak_tflops * 1e12)  # None: a GPU's from its name
        if rank == 0:
            import_in_background()  # matplotlib, for the loss plot at the end
        with state.saver:  # every checkpoint written (or its error raised) before train returns
            with stop_requests() as stop:
                while True:
                    if state.step % cfg.eval_interval == 0 or state.step == cfg.max_iters:
                        if not evaluate(state, eval_batches, amp, rows, log, stop):
                            break  # a signal during the evaluation: every rank stops here
                        speed.restart()  # throughput counts training only
                    if state.step == cfg.max_iters:
                        break
                    lr = lr_at(state.step, cfg)
                    loss = step(lr)
                    state.step += 1
                    speed.step_done()
                    if state.step % cfg.log_interval == 0 or state.step == cfg.max_iters:
                        loss = mean_over_ranks(loss.detach())
                        if not math.isfinite(loss_value := loss.item()):
                            raise state.diverged("loss", loss_value)
                        log.training_step(state.step, loss_value, lr, *speed.read())
                    log.bar.update(1)
                    if stop.on_any_rank(device, state.step, min(cfg.log_interval, STOP_CHECK_STEPS)):
                        break
                # inside: a signal during the whole split's loss or the sample stops them cleanly too, not
                # the process, which would kill the last checkpoint's write (in the background till then)
                return finish(state, log, amp, stop)
    except (MemoryError, RuntimeError) as e:  # (torch.OutOfMemoryError is a RuntimeError)
        if (error := out_of_memory(e, cfg.batch_size, device)) is None:
            raise
        raise error from e
    finally:
        release_run_dir(run_dir)


# ----------------------------------------------------------------------------- evaluate and save

def evaluate(state: TrainingState, eval_batches: dict, amp, rows: slice, log: MetricsLog, stop) -> bool:
    """Evaluate on the fixed batches (each rank its rows); save best.pt if val improved, and ckpt.pt.
    False, with nothing recorded or saved, when a signal stopped it (on any rank: every rank agrees)."""
    cfg = state.run.train
    with eager(state):
        losses = estimate_loss(state.model, eval_batches, cfg.eval_iters, cfg.seed, amp, rows, stop)
    if stop.on_any_rank(state.device):
        return False
    log.record({"step": state.step, "train_loss": losses["train"], "val_loss": losses["val"]})
    print0(f"step {state.step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
    if not math.isfinite(losses["val"]):
        raise state.diverged("val loss", losses["val"])
    if state.step > 0 or state.step == cfg.max_iters:
        improved = losses["val"] < state.best_val
        state.best_val = min(state.best_val, losses["val"])
        # best.pt, when val improved, is the file ckpt.pt is now: one write, in the background
        state.last_saved = state.save("ckpt.pt", also=["best.pt"] if improved else [])
    return True


def finish(state: TrainingState, log: MetricsLog, amp, stop: list) -> dict:
    """The whole val split's loss, the loss plot and a sample; or, after a signal, ckpt.pt. A signal
    during the sample ends it there, the run complete and saved: the result says it (`interrupted`)."""
    cfg, run_dir, full_val = state.run.train, state.run_dir, None
    stop.on_any_rank(state.device)  # a signal since the loop's last check: every rank agrees
    if not stop and cfg.full_val:
        full_val = whole_val_loss(state, log, amp, stop)
    log.close()
    if stop:
        path = state.save("ckpt.pt", stopping=True)
        state.saver.wait()
        print0(f"{signal.Signals(stop[0]).name}: saved {path} at step {state.step}; continue with: "
               f"python train.py train.resume={run_dir}")
        return {"interrupted": stop[0], "step": state.step, "checkpoint": path, "run_dir": run_dir}
    if state.rank == 0:
        with run_dir_write():
            plot_losses(run_dir, run_dir / LOSS_PLOT)
        if cfg.sample_tokens > 0:
            tok = tokenizer_from_meta(state.run.meta)
            with eager(state):
                ids = sample_ids(state.model, start_ids(tok), cfg.sample_tokens, cfg.seed, tok.vocab_size,
                                 stop)  # a signal ends the sample: the run is complete and saved
            ended = f"stopped by {signal.Signals(stop[0]).name}" if stop else "end of sample"
            print0(f"--- sample ---{tok.decode(ids)}\n--- {ended} ---")
    state.saver.wait()  # the last checkpoint on disk: the path printed is a complete file
    best = run_dir / "best.pt" if (run_dir / "best.pt").is_file() else state.last_saved  # resumed, not beaten
    note = " (from before the resume)" if best and best.name != "best.pt" else ""
    print0(f"best val loss {state.best_val:.4f}{note}; checkpoint: {best or 'none (checkpoints=false)'}")
    return {"step": state.step, "best_val": state.best_val, "val_loss_full": full_val, "checkpoint": best,
            "run_dir": run_dir} | ({"interrupted": stop[0]} if stop else {})


def whole_val_loss(state: TrainingState, log: MetricsLog, amp, stop) -> float | None:
    """Rank 0 records the loss over every token of the val split, batch_size windows at once (as
    training) and returns it; None on the other ranks, or when a signal stopped it (on any rank:
    then every rank has one, and saves)."""
    full_val = None
    if state.rank == 0:
        _, _, val_tokens = load_prepared(state.run.data_dir)
        with eager(state):
            full_val = split_loss(state.model, torch.from_numpy(val_tokens.astype("int64")), amp,
                                  state.run.train.batch_size, stop=stop)
        if not stop:
            log.record({"step": state.step, "val_loss_full": full_val})
            print0(f"step {state.step}: val loss {full_val:.4f} over the whole val split "
                   f"({len(val_tokens):,} tokens)")
    return None if stop.on_any_rank(state.device) else full_val
