"""The plain static KV cache: each layer's keys and values kept across decode steps, so that a new
token computes only its own. Preallocated and written in place (position p in cell p), never grown:
its shapes never change, so a decode step can be compiled."""

import torch


class KVCache:
    """K and V of every layer, (n_layer, B, n_kv_head, max_len, head_dim) each. `length` counts the
    positions written; the model writes each layer's new ones (`update`), then `advance`s it."""

    def __init__(self, n_layer, batch_size, n_kv_head, max_len, head_dim, dtype=torch.float32, device=None):
        shape = (n_layer, batch_size, n_kv_head, max_len, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.max_len, self.length = max_len, 0

    def update(self, layer: int, k, v):
        """Write layer `layer`'s k and v (B, n_kv_head, T, head_dim) at the T positions after the
        `length` written; return its K and V of every position so far, (B, n_kv_head, length + T, hd)."""
        end = self.length + k.size(2)
        self.k[layer, :, :, self.length:end] = k
        self.v[layer, :, :, self.length:end] = v
        return self.k[layer, :, :, :end], self.v[layer, :, :, :end]

    def advance(self, n: int) -> None:
        """Count n more positions as written (every layer has written them)."""
        self.length += n

    def reset(self) -> None:
        """Forget every position: the next are written from cell 0."""
        self.length = 0
