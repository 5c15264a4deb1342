"""The RNG state a training checkpoint keeps, one per process, so that a resumed run draws exactly
what the run it continues would have drawn."""

import random

import numpy as np
import torch

from training.distributed import gather_from_ranks


def seed_rngs(seed: int) -> None:
    """Seed the process-wide RNGs that rng_state() saves (CUDA's with torch's)."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)  # numpy's legacy seeds are 32-bit
    random.seed(seed)


def rng_state(device: torch.device) -> dict:
    """This process's RNGs (torch, its CUDA device's, numpy, python), as tensors and plain data.
    A training checkpoint keeps one per process (see restore_rng)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "python": random.getstate(),
    }


def rng_states_of_ranks(device: torch.device) -> list[dict]:
    """Every process's rng_state(), in rank order, gathered to each (one in a single process)."""
    return gather_from_ranks(rng_state(device))


def restore_rng(processes: list[dict], rank: int, device: torch.device) -> None:
    """Restore this process's RNGs from the rng_state() of each process of the saving run: rank r
    takes rank r's, its CUDA state only onto its own device. A rank the saving run did not have
    keeps its fresh seed, and a state saved on CUDA is skipped on a CPU: resuming with more or
    fewer GPUs, or none, works (the dropout masks are then new ones)."""
    if rank >= len(processes):
        return
    state = processes[rank]
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(state["python"])
