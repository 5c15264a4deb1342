"""Random contiguous windows of a token array, reproducible from a seed or a saved RNG state."""

import numpy as np
import torch


class Batches:
    """Draws (x, y) batches of shape (batch_size, block_size) where y is x shifted by one.

    `on_device=True` keeps the whole split as one tensor on `device` and gathers windows there
    (the fast path for small corpora); otherwise windows are read from the memory-mapped array
    and sent through pinned memory with non_blocking copies.
    """

    def __init__(self, tokens: np.ndarray, block_size: int, batch_size: int, *, device="cpu",
                 seed: int = 0, on_device: bool = True):
        if len(tokens) <= block_size:
            raise ValueError(f"block_size={block_size} needs more tokens than {len(tokens):,}")
        self.block_size, self.batch_size = block_size, batch_size
        self.device = torch.device(device)
        self.on_device = on_device
        self.tokens = torch.from_numpy(tokens.astype(np.int64)).to(self.device) if on_device else tokens
        self.generator = torch.Generator().manual_seed(seed)
        self.offsets = torch.arange(block_size + 1)

    def next(self):
        starts = torch.randint(len(self.tokens) - self.block_size, (self.batch_size,),
                               generator=self.generator)
        if self.on_device:
            windows = self.tokens[(starts[:, None] + self.offsets).to(self.device)]  # (B, block+1)
        else:
            rows = [self.tokens[s : s + self.block_size + 1] for s in starts.tolist()]
            windows = torch.from_numpy(np.stack(rows).astype(np.int64))          # (B, block+1)
            if self.device.type == "cuda":
                windows = windows.pin_memory().to(self.device, non_blocking=True)
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.generator.set_state(state["generator"])
