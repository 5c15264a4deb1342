"""A training run's options: `TrainConfig`, the `train` group's schema (each value checked when it is
made), and `RunConfig`, every option of a run checked (cli.options.check_options makes it) and all
that `training.loop.train` reads; and whether a model and a batch fit in a device's memory (and the
error, naming train.batch_size, when an allocation fails all the same)."""

import math
import re
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

# The counts that cost time or memory, each at most what a user could mean: past it, a run would
# not end (nor stop for a signal, within a step) in any time one waits for. The message says why.
MAX_COUNTS = {
    "grad_accum": (1024, "micro-steps in each optimizer step, whose batches are drawn at once and which a "
                         "signal does not stop: for a larger batch raise train.batch_size too"),
    "eval_iters": (10_000, "batches per split at every evaluation; the loss over the whole val split is "
                           "train.full_val's"),
    "sample_tokens": (10_000, "the sample printed at the end; python generate.py streams longer ones"),
}

# train.peak_tflops, MFU's denominator, within what a device could do: a GFLOP/s to an exaFLOP/s (an
# MFU over 1e-320 TFLOP/s overflowed to Infinity, which no JSON reader takes).
MIN_PEAK_TFLOPS, MAX_PEAK_TFLOPS = 1e-3, 1_000_000


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
                 "> 0": (lambda v: v > 0, "lr"),
                 f"a device's peak, {MIN_PEAK_TFLOPS:g} to {MAX_PEAK_TFLOPS:,} (TFLOP/s), or null": (
                     lambda v: v is None or MIN_PEAK_TFLOPS <= v <= MAX_PEAK_TFLOPS, "peak_tflops"),
                 "in [0, 1)": (lambda v: 0 <= v < 1, "beta1 beta2"),
                 "one of auto, float32, bfloat16": (lambda v: v in ("auto", "float32", "bfloat16"), "dtype"),
                 "one of auto, true, false, blocks": (
                     lambda v: v in ("auto", "blocks") or isinstance(v, bool), "compile"),
                 "one of auto, true, false": (lambda v: v == "auto" or isinstance(v, bool), "cuda_graph")}
        for rule, (holds, names) in rules.items():
            for name in names.split():
                if not holds(getattr(self, name)):
                    raise ValueError(f"train.{name} must be {rule}, got {getattr(self, name)!r}")
        for name, (most, why) in MAX_COUNTS.items():
            if (value := getattr(self, name)) > most:
                raise ValueError(f"train.{name} must be at most {most:,} ({why}), got {value:,}")
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


def check_fits(model: GPTConfig, batch_size: int, device: torch.device, dtype: str = "auto") -> None:
    """The model and a batch of batch_size sequences fit in the device's memory by what one training
    step holds at its peak (training_step_bytes), under train.dtype `dtype`. A run past it could only
    fail, or be killed by the OOM killer without a word, once it has started."""
    c = model
    bf16 = dtype == "bfloat16" or (dtype == "auto" and device.type == "cuda")  # (training's autocast)
    state, batch = training_step_bytes(c, batch_size, 2 if bf16 else 4)
    if (need := state + batch) > (have := memory_bytes(device)):
        raise ValueError(f"training this model takes about {need / 2**30:,.1f} GiB a step "
                         f"({state / 2**30:,.1f} GiB for its {state // 16:,} parameters' weights, gradients "
                         f"and AdamW state, {batch / 2**30:,.1f} GiB for the activations of a batch of "
                         f"{batch_size} x {c.block_size} tokens), more than the {have / 2**30:,.1f} GiB of "
                         f"{device}: lower train.batch_size or the model's size (model.n_layer, n_embd, "
                         f"block_size, vocab_size)")


def out_of_memory(error: BaseException, batch_size: int, device: torch.device) -> MemoryError | None:
    """The user's error for an allocation that failed while training (a CPU allocator's RuntimeError,
    Python's MemoryError, CUDA's torch.OutOfMemoryError): what check_fits could not foresee, such as
    a memory limit below the machine's (ulimit -v, a container's) or memory other processes hold.
    None for any other error."""
    text = str(error)
    if not (isinstance(error, (MemoryError, torch.OutOfMemoryError)) or "can't allocate memory" in text
            or "out of memory" in text.lower()):
        return None
    size = re.search(r"tried to allocate (\d+ bytes|[\d.]+ [KMGT]i?B)", text, re.IGNORECASE)
    if size and size[1].endswith("bytes"):
        tried = f" (an allocation of {int(size[1].split()[0]) / 2**30:,.2f} GiB failed)"
    else:
        tried = f" (an allocation of {size[1]} failed)" if size else ""
    return MemoryError(f"out of memory on {device}{tried}: lower train.batch_size={batch_size} (raise "
                       f"train.grad_accum to keep the tokens per step) or the model's size (model.n_layer, "
                       f"n_embd, block_size)")


def training_step_bytes(c: GPTConfig, batch_size: int, activation_bytes: int = 4) -> tuple[int, int]:
    """(bytes of the parameters' state, bytes of a batch's activations) at the peak of a training step
    (its backward pass), counted from the config. 16 bytes a parameter: float32 weights, gradients
    and AdamW's two moments. Per token, the numbers autograd keeps for the backward pass, of
    `activation_bytes` each (4 in float32; 2 under bf16 autocast, which keeps some in float32, so
    there a lower bound): in every layer 8 n_embd (the norms' inputs and outputs, attention's output,
    the projection's input) + 2 kv_width (K, V) + the MLP's hidden units, GELU's twice, SwiGLU's three
    times; + n_embd + kv_width to rotate q and k (RoPE), + 2 n_embd for RMSNorm, + 3 (n_embd +
    kv_width) for qk_norm; + n_head x block_size / 2 where attention's weights are made (the naive
    backend, dropout; SDPA's fused kernels make none) and 3 n_embd of dropout masks. Then 6 n_embd of
    the embeddings and the last norm, and 4 vocab_size in float32: the logits, their log-softmax and
    both gradients, which dominate a small model with a large vocabulary.

    Calibrated on a CPU step's peak RSS less the memory before it (float32, eager, 4 layers x 128
    wide, 2,048 to 65,536 tokens a batch): 95-106% of it for the plain model at any batch, block and
    vocabulary size, with MQA, shared K/V, windows, qk_norm; 75-95% with RoPE, RMSNorm and SwiGLU
    together or apart (their intermediate tensors overlap unevenly); 50-75% for dropout, MLA's
    expanded keys and values, the naive backend and sink logits."""
    C, L = c.n_embd, c.n_layer
    positions = c.block_size * (c.pos_emb == "learned")
    params = (c.vocab_size * (1 + (not c.tie_embeddings)) + positions) * C + L * (10 * C**2)  # (at least)
    if c.mla_latent_dim is None:  # K and V of the layers that make them (kv_share), averaged
        kv_width = c.n_kv_head * c.head_dim * c.kv_layers / L
    else:  # the plain form expands MLA's latent into K and V per head
        kv_width = C
    hidden = 8 * math.ceil(C / 3) * 3 if c.mlp == "swiglu" else 4 * C * 2  # (MLP's own sizes)
    per_layer = 8 * C + 2 * kv_width + hidden + 3 * (C + kv_width) * c.qk_norm
    per_layer += (C + kv_width) * (c.pos_emb == "rope") + 2 * C * (c.norm == "rmsnorm")
    if c.attn_backend == "naive" or c.dropout > 0:
        per_layer += c.n_head * c.block_size / 2 + 3 * C * (c.dropout > 0)
    per_token = activation_bytes * (L * per_layer + 6 * C) + 4 * 4 * c.vocab_size
    return 16 * params, int(batch_size * c.block_size * per_token)
