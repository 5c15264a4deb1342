"""A static, preallocated key/value cache: fixed shapes, written in place, never grown."""

import torch


class KVCache:
    """Per slot (one layer, or one group of `GPTConfig.kv_share` layers), K and V of shape
    (B, n_kv_head, max_len, key_dim). With `value_dim_in_keys=L`, each V is a view of its K's first
    L columns (MLA caches one latent that serves as both), so only K takes memory. Only the cache
    moves `length`; slots past it hold stale values the mask hides, so shapes never change and decode
    can be compiled."""

    def __init__(self, n_slots, batch_size, n_kv_head, max_len, key_dim, *, value_dim_in_keys=0,
                 dtype=torch.float32, device=None):
        shape = (batch_size, n_kv_head, max_len, key_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_slots)]
        if value_dim_in_keys:
            self.v = [k[..., :value_dim_in_keys] for k in self.k]  # views: no memory of their own
        else:
            self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_slots)]
        self.value_dim_in_keys = value_dim_in_keys
        self.batch_size, self.max_len = batch_size, max_len
        self.length = 0

    def update(self, slot, input_pos, k, v=None, written_only=False):
        """Write k (B, n_kv_head, T, key_dim) and v at positions input_pos (T,) of the first B rows
        (a batch smaller than the cache uses those); return the slot's K, V for them: every slot, or
        with `written_only` (a prefill into an empty cache) the first T, so that plain causal
        attention applies."""
        B, T = k.shape[0], k.shape[2]
        keys, values = self.k[slot][:B], self.v[slot][:B]               # (B, n_kv_head, max_len, dim)
        keys.index_copy_(2, input_pos, k.to(keys.dtype))
        if not self.value_dim_in_keys:
            values.index_copy_(2, input_pos, v.to(values.dtype))
        if written_only:
            return keys[:, :, :T], values[:, :, :T]                       # (B, n_kv_head, T, dim)
        return keys, values

    def advance(self, n: int) -> None:
        """Count n more positions as written; callers check for room, so overflowing is a bug."""
        if self.length + n > self.max_len:
            raise RuntimeError(f"{self.length + n} positions exceed the cache size {self.max_len}")
        self.length += n

    def reset(self) -> None:
        self.length = 0

    def keep_last(self, n: int) -> None:
        """Move the last n written positions to slots 0 .. n-1: what a slot holds does not depend on
        the slot (RoPE rotates by position, and the caller's pad keeps the positions)."""
        for t in self.buffers:
            t[:, :, :n] = t[:, :, self.length - n:self.length].clone()  # (B, heads, n, dim); overlapping
        self.length = n

    def write_rows(self, rows, start: int, source: "KVCache") -> None:
        """Copy `source`'s written positions into batch rows `rows` (one per source row), from `start`."""
        for t, s in zip(self.buffers, source.buffers):
            t[rows, :, start:start + source.length] = s[:, :, :source.length]

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The tensors that hold the cache's memory: every K, and every V that is not a view of its K."""
        return self.k + ([] if self.value_dim_in_keys else self.v)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.buffers)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one position of one sequence takes across all slots (GPTConfig.kv_cache_formula)."""
        return self.nbytes // (self.batch_size * self.max_len)
