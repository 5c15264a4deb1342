"""A model's loss on a split: the quick estimate training prints (a few fixed random batches) and
the exact one (every token of the split predicted once, in block-sized windows); and the sample a
run ends with (`sample_ids`)."""

import itertools
import math
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from model.config import check_integer
from model.decode_step import CompiledDecodeStep
from model.generation import Decoding, new_tokens_allowed, stream
from model.kv_cache import storage_dtype
from model.sampling import Sampling
from training.distributed import mean_over_ranks


@torch.no_grad()
def estimate_loss(model, splits: dict, iters: int, seed: int, amp, rows: slice = slice(None),
                  stop=()) -> dict:
    """Mean loss over `iters` batches per split (Batches objects), the same batches at every
    evaluation: cheap, and noisy by about +-0.01 at 20 batches of 12 x 64 tokens. Under torchrun
    each process takes its `rows` of every batch, and the means are averaged over the processes.
    The losses stay on the device until the end: one synchronisation per split. `stop` (a list a
    signal handler appends to) ends the batches at the first signal, within one batch, not `iters`
    later: the losses are then partial, for no one to record. The batches' RNG is left as it was."""
    model.eval()
    out = {}
    for name, batches in splits.items():
        saved = batches.state_dict()
        batches.generator.manual_seed(seed)
        total = torch.zeros((), device=batches.device)
        for _ in range(iters):
            if stop:
                break
            x, y = batches.next()
            with amp:
                total += model(x[rows], y[rows])[1].float()
        batches.load_state_dict(saved)
        out[name] = mean_over_ranks(total / iters).item()
    model.train()
    return out


@torch.no_grad()
def split_loss(model, tokens: torch.Tensor, amp=None, windows_per_batch: int = 16, kv_dtype=None,
               stop=()) -> float:
    """Mean cross-entropy of predicting every token of `tokens` (1-D) from the ones before it in
    its window: the split is cut into consecutive windows of block_size (the last one shorter),
    so each of its len - 1 targets is predicted exactly once, with 0 .. block_size - 1 tokens of
    context. The honest number to compare runs by. With `kv_dtype`, each window goes through a KV
    cache that stores in it (torch.int8, ...): teacher-forced, every position attends to the keys
    and values as that cache holds them, which is what decoding through it computes. `stop` (a
    list a signal handler appends to) ends it at the first signal, within one batch of windows:
    the loss is then partial, for no one to record."""
    if tokens.dim() != 1 or len(tokens) < 2 or tokens.is_floating_point():
        raise ValueError(f"tokens must be a 1-D split of 2 token ids or more, got {tokens.dtype} "
                         f"{tuple(tokens.shape)}")
    check_integer(windows_per_batch, "windows_per_batch", 1)
    kv_dtype = None if kv_dtype is None else storage_dtype(kv_dtype, "kv_dtype")
    device = next(model.parameters()).device
    x, y = target_windows(tokens, model.config.block_size)              # (n_windows, block_size) each
    n_targets = len(tokens) - 1
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(0, len(x), windows_per_batch):
        if stop:
            break
        xb, yb = x[i:i + windows_per_batch].to(device), y[i:i + windows_per_batch].to(device)
        with amp or nullcontext():
            cache = None if kv_dtype is None else model.new_kv_cache(len(xb), dtype=kv_dtype)
            logits = model(xb, kv_cache=cache)                          # (b, block_size, vocab)
        total += F.cross_entropy(logits.flatten(0, 1).float(), yb.flatten(), ignore_index=-1,
                                 reduction="sum").item()
    model.train(was_training)
    return total / n_targets


def target_windows(tokens: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A 1-D split cut into consecutive windows of block_size: inputs and targets (n_windows,
    block_size) each, on the CPU, the last window padded with targets -1 (ignored)."""
    n_targets = len(tokens) - 1
    n_windows = math.ceil(n_targets / block_size)
    x = torch.zeros(n_windows * block_size, dtype=torch.long)
    y = torch.full((n_windows * block_size,), -1, dtype=torch.long)  # -1: padding, ignored
    x[:n_targets], y[:n_targets] = tokens[:-1].cpu(), tokens[1:].cpu()
    return x.view(n_windows, block_size), y.view(n_windows, block_size)


def sample_ids(model, prompt: list[int], max_new_tokens: int, seed: int, vocab_size=None,
               stop=()) -> list[int]:
    """A sample as nanoGPT's sample.py draws it (temperature 0.8, top_k 200, seeded): `prompt` and
    max_new_tokens after it, fewer where the model's positions end sooner (new_tokens_allowed), or
    where `stop` (a list a signal handler appends to) gets a signal: the tokens drawn until then. On
    CUDA each token is one replay of the step captured as a CUDA graph, as `generate.py` samples
    there, not a pass of the model launched kernel by kernel from Python."""
    device = model.wte.weight.device
    n = min(max_new_tokens, new_tokens_allowed(model.config, len(prompt)))
    step = CompiledDecodeStep(model.eval(), backend="cuda_graph") if device.type == "cuda" and n > 1 else None
    sampling, generator = Sampling(n, temperature=0.8, top_k=200), torch.Generator(device=device)
    tokens = stream(model.eval(), torch.tensor([prompt], device=device), sampling,
                    Decoding(decode_step=step, vocab_size=vocab_size), generator=generator.manual_seed(seed))
    new = list(itertools.takewhile(lambda token: not stop, tokens))     # (1,) each, on the device
    return prompt + (torch.cat(new).tolist() if new else [])
