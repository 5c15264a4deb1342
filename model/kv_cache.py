"""A static, preallocated key/value cache: fixed shapes, written in place, never grown."""

import torch


class KVCache:
    """Per layer, K and V of shape (B, n_kv_head, max_len, hd).

    `length` counts the positions written so far, and only the cache changes it (`advance`,
    `reset`): the GPT writes new keys/values at slots length .. length+T-1, then advances the
    cache by T. Slots past `length` hold stale values that the attention mask hides, so the shapes
    never change (which is what lets decode be compiled).
    """

    def __init__(self, n_layer, batch_size, n_kv_head, max_len, head_dim, *,
                 dtype=torch.float32, device=None):
        shape = (batch_size, n_kv_head, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_layer)]
        self.batch_size, self.max_len = batch_size, max_len
        self.length = 0

    def update(self, layer, input_pos, k, v):
        """Write k, v (B, n_kv_head, T, hd) at slots input_pos (T,); return the whole layer."""
        self.k[layer].index_copy_(2, input_pos, k.to(self.k[layer].dtype))
        self.v[layer].index_copy_(2, input_pos, v.to(self.v[layer].dtype))
        return self.k[layer], self.v[layer]

    def advance(self, n: int) -> None:
        """Count n more positions as written. Callers check the room first (GPT.forward,
        generation's refill), so running past the end is a bug, not a user error."""
        if self.length + n > self.max_len:
            raise RuntimeError(f"{self.length + n} positions exceed the cache size {self.max_len}")
        self.length += n

    def reset(self) -> None:
        self.length = 0

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one position of one sequence takes across all layers: 2·n_layer·n_kv_head·hd·dtype."""
        return self.nbytes // (self.batch_size * self.max_len)
