"""Random contiguous windows of a token array, reproducible from a seed or a saved RNG state."""

import numpy as np
import torch


class Batches:
    """Draws (x, y) batches of shape (batch_size, block_size) where y is x shifted by one.

    `on_device=True` keeps the whole split on `device` as one int32 tensor and gathers windows there
    (the fast path for small corpora); `tokens` may be such a tensor already, which several Batches
    then share. Otherwise windows are read from the memory-mapped array and sent through pinned
    memory. The window starts are drawn on the CPU, from a generator whose state is saved, and go
    to the device without waiting for it: drawing a batch never synchronises with a GPU.
    """

    def __init__(self, tokens, block_size: int, batch_size: int, *, device="cpu", seed: int = 0,
                 on_device: bool = True):
        if len(tokens) <= block_size:
            raise ValueError(f"block_size={block_size} needs more tokens than {len(tokens):,}")
        self.block_size, self.batch_size = block_size, batch_size
        self.device = torch.device(device)
        self.on_device = on_device
        if on_device and not isinstance(tokens, torch.Tensor):
            tokens = torch.from_numpy(tokens.astype(np.int32)).to(self.device)
        self.tokens = tokens
        self.generator = torch.Generator().manual_seed(seed)
        self.offsets = torch.arange(block_size + 1, device=self.device)

    def next(self):
        starts = torch.randint(len(self.tokens) - self.block_size, (self.batch_size,),
                               generator=self.generator)
        if self.on_device:
            starts = to_device(starts, self.device)
            windows = self.tokens[starts[:, None] + self.offsets].long()                # (B, block+1)
        else:
            rows = [self.tokens[s : s + self.block_size + 1] for s in starts.tolist()]
            windows = torch.from_numpy(np.stack(rows).astype(np.int64))                 # (B, block+1)
            windows = to_device(windows, self.device)
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device`; to a GPU through pinned memory, a copy the host does not wait for."""
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
