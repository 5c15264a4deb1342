"""A training run's options: `TrainConfig`, the `train` group's schema (each value checked when it is
made), and `RunConfig`, every option of a run checked (cli.options.check_options makes it) and all
that `training.loop.train` reads; and whether a model and a batch fit in a device's memory."""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from data.prepare import DataConfig
from model import GPTConfig
from model.checkpoint import Checkpoint
from model.config import check_integer_fields
from model.device import check_device, memory_bytes
from training.optimizer import OPTIMIZERS


@dataclass
class TrainConfig:
    """The `train` group (configs/train/default.yaml): optimizer, schedule and loop settings."""

    seed: int = 1337
    device: str = "auto"          # auto | cpu | cuda | cuda:N
    dtype: str = "auto"           # auto (bf16 autocast on CUDA, float32 on CPU) | float32 | bfloat16
    compile: Any = "auto"         # auto (on for CUDA) | true | false | blocks (each Block: one graph for all)
    cuda_graph: Any = "auto"      # auto (CUDA, one process, AdamW) | true | false: the step as a CUDA graph
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
    checkpoints: bool = True      # false: none at evaluations or the end (timing runs); signals still save
    peak_tflops: float | None = None  # the GPU's dense bf16 peak for MFU; None: from its name

    def __post_init__(self):
        check_integer_fields(self, "train.")
        rules = {">= 1": (lambda v: v >= 1, "batch_size grad_accum eval_interval eval_iters log_interval"),
                 ">= 0": (lambda v: v >= 0, "seed max_iters warmup_iters lr_decay_iters min_lr weight_decay "
                                            "grad_clip sample_tokens"),
                 "> 0": (lambda v: v is None or v > 0, "lr peak_tflops"),
                 "in [0, 1)": (lambda v: 0 <= v < 1, "beta1 beta2"),
                 "one of auto, float32, bfloat16": (lambda v: v in ("auto", "float32", "bfloat16"), "dtype"),
                 "one of auto, true, false, blocks": (
                     lambda v: v in ("auto", "blocks") or isinstance(v, bool), "compile"),
                 "one of auto, true, false": (lambda v: v == "auto" or isinstance(v, bool), "cuda_graph")}
        for rule, (holds, names) in rules.items():
            for name in names.split():
                if not holds(getattr(self, name)):
                    raise ValueError(f"train.{name} must be {rule}, got {getattr(self, name)!r}")
        if self.min_lr > self.lr:
            raise ValueError(f"train.min_lr={self.min_lr} must not exceed train.lr={self.lr}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"train.optimizer={self.optimizer!r} is not one of {', '.join(OPTIMIZERS)}")
        if self.cuda_graph is True and self.optimizer != "adamw":
            raise ValueError(f"train.cuda_graph=true replays AdamW's step, not {self.optimizer}'s: use "
                             f"train.optimizer=adamw or train.cuda_graph=false")
        check_device(self.device, "train.device")


@dataclass
class RunConfig:
    """A run's options, every one checked (check_options): what train() needs and nothing else."""

    config: dict                  # the resolved config, as checkpoints save it
    train: TrainConfig
    data: DataConfig
    model: GPTConfig              # the model trained: the data's vocabulary, init_from's architecture
    device: torch.device
    data_dir: Path                # the prepared token arrays
    meta: dict                    # their tokenizer
    source: Checkpoint | None = None   # the checkpoint resumed or started from

    def tokens_per_step(self, world_size: int) -> int:
        """Tokens one optimizer step trains on, over all processes."""
        return self.train.batch_size * world_size * self.train.grad_accum * self.model.block_size


def check_fits(model: GPTConfig, batch_size: int, device: torch.device) -> None:
    """The model and a batch fit in the device's memory by a lower bound of what training takes:
    16 bytes a parameter (float32 weights, gradients and AdamW's two moments; the parameters counted
    from the config, at least 10 n_embd^2 a layer), and 4 bytes a number of a batch's logits and of
    one residual stream a layer. A run past it could only fail, or be killed, once it has started."""
    c = model
    positions = c.block_size * (c.pos_emb == "learned")
    params = (c.vocab_size + positions) * c.n_embd + 10 * c.n_layer * c.n_embd**2
    batch = 4 * batch_size * c.block_size * (c.vocab_size + c.n_layer * c.n_embd)
    if (need := 16 * params + batch) > (have := memory_bytes(device)):
        raise ValueError(f"training this model takes at least {need / 2**30:,.1f} GiB ({params:,} "
                         f"parameters, batches of {batch_size} x {c.block_size} tokens), more than the "
                         f"{have / 2**30:,.1f} GiB of {device}: lower train.batch_size or the model's size "
                         f"(model.n_layer, n_embd, block_size, vocab_size)")
