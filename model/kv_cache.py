"""A static, preallocated key/value cache: fixed shapes, written in place, never grown."""

import torch


class KVCache:
    """Per slot, K and V of shape (B, n_kv_head, max_len, key_dim).

    A slot is one layer's keys and values, or one group's when adjacent layers share them
    (`GPTConfig.kv_share`): n_slots = ceil(n_layer / kv_share). With `values_in_keys=L`, there
    is no separate V: each V is a view of its K's first L columns (multi-head latent attention
    caches one latent that serves as both), so only K takes memory.

    `length` counts the positions written so far, and only the cache changes it (`advance`,
    `reset`): the GPT writes new keys/values at slots length .. length+T-1, then advances the
    cache by T. Slots past `length` hold stale values that the attention mask hides, so the shapes
    never change (which is what lets decode be compiled).
    """

    def __init__(self, n_slots, batch_size, n_kv_head, max_len, key_dim, *, values_in_keys=0,
                 dtype=torch.float32, device=None):
        shape = (batch_size, n_kv_head, max_len, key_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_slots)]
        if values_in_keys:
            self.v = [k[..., :values_in_keys] for k in self.k]  # views: no memory of their own
        else:
            self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_slots)]
        self.values_in_keys = values_in_keys
        self.batch_size, self.max_len = batch_size, max_len
        self.length = 0

    def update(self, slot, input_pos, k, v=None):
        """Write k (B, n_kv_head, T, key_dim), and v unless the values live in the keys, at
        positions input_pos (T,); return the whole slot's K and V."""
        self.k[slot].index_copy_(2, input_pos, k.to(self.k[slot].dtype))
        if not self.values_in_keys:
            self.v[slot].index_copy_(2, input_pos, v.to(self.v[slot].dtype))
        return self.k[slot], self.v[slot]

    def advance(self, n: int) -> None:
        """Count n more positions as written. Callers check the room first (GPT.forward,
        generation's refill), so running past the end is a bug, not a user error."""
        if self.length + n > self.max_len:
            raise RuntimeError(f"{self.length + n} positions exceed the cache size {self.max_len}")
        self.length += n

    def reset(self) -> None:
        self.length = 0

    def keep_last(self, n: int) -> None:
        """Keep the last n written positions, moved to slots 0 .. n-1. What a slot holds does not
        depend on the slot (RoPE rotates by position, and the caller's pad keeps the positions)."""
        for t in self.buffers:
            t[:, :, :n] = t[:, :, self.length - n:self.length].clone()  # (B, heads, n, dim); overlapping
        self.length = n

    def write_rows(self, rows, start: int, source: "KVCache") -> None:
        """Copy the positions written in `source` into batch rows `rows` (a LongTensor with one
        per row of source), at slots start .. start + source.length - 1."""
        for t, s in zip(self.buffers, source.buffers):
            t[rows, :, start:start + source.length] = s[:, :, :source.length]

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The tensors that hold the cache's memory: every K, and every V that is not a view of its K."""
        return self.k + ([] if self.values_in_keys else self.v)

    @property
    def nbytes(self) -> int:
        """The memory the cache holds (values that are views of the keys count once)."""
        return sum(t.nbytes for t in self.buffers)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one position of one sequence takes across all slots (GPTConfig.kv_cache_formula)."""
        return self.nbytes // (self.batch_size * self.max_len)
