"""A static, preallocated key/value cache: fixed shapes, written in place, never grown. It stores
in float32, bfloat16 or int8 (one scale per position and head), and for a sliding-window model it
is a ring of window slots that position p overwrites at slot p % window."""

import torch

KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}  # what a cache stores


def storage_dtype(dtype, name: str = "dtype") -> torch.dtype:
    """The dtype a cache stores in, given as one of KV_DTYPES' dtypes or names; anything else (an
    integer dtype would truncate keys and values) is a ValueError naming the argument `name`."""
    dtype = KV_DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if not isinstance(dtype, torch.dtype) or dtype not in KV_DTYPES.values():
        raise ValueError(f"{name} must be one of {', '.join(KV_DTYPES)} (a torch dtype or its name), "
                         f"got {dtype!r}")
    return dtype


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) -> (int8 (..., D), scale (..., 1) in float32): symmetric absmax, one scale per
    row, so x ~ int8 * scale with an error of at most scale / 2 per number."""
    scale = x.float().abs().amax(dim=-1, keepdim=True) / 127                 # (..., 1)
    q = (x.float() / scale.clamp(min=torch.finfo(torch.float32).tiny)).round().clamp(-127, 127)
    return q.to(torch.int8), scale


class KVCache:
    """Per slot (one layer, or one group of `GPTConfig.kv_share` layers), K and V of shape
    (B, n_kv_head, max_len, key_dim) in `dtype`, handed to attention in `compute_dtype`. With
    dtype int8, each position of each head has a scale (B, n_kv_head, max_len, 1) in compute_dtype.
    With `value_dim_in_keys=L`, each V is K's first L columns (MLA caches one latent that serves as
    both), so only K takes memory. With `ring`, max_len is a sliding window: position p lives in
    slot p % max_len, and positions never run out. Only the cache moves `length` (the positions
    written); slots past it hold stale values the mask hides, so shapes never change and decode can
    be compiled. Storing in another dtype, it keeps one slot's K and V in compute_dtype too
    (`read_buffer`), into which each layer converts its own: much faster than a fresh tensor."""

    def __init__(self, n_slots, batch_size, n_kv_head, max_len, key_dim, *, value_dim_in_keys=0,
                 dtype=torch.float32, compute_dtype=None, ring=False, device=None):
        shape, scale_shape = (batch_size, n_kv_head, max_len, key_dim), (batch_size, n_kv_head, max_len, 1)
        self.quantized = dtype == torch.int8
        self.dtype, self.compute_dtype = dtype, compute_dtype or (torch.float32 if self.quantized else dtype)
        self.value_dim_in_keys = value_dim_in_keys
        self.batch_size, self.max_len, self.ring = batch_size, max_len, ring
        kv = ["k"] if value_dim_in_keys else ["k", "v"]
        self.stored = {name: [torch.zeros(shape, dtype=dtype, device=device) for _ in range(n_slots)]
                       for name in kv}
        if self.quantized:
            self.stored |= {f"{name}_scale": [torch.zeros(scale_shape, dtype=self.compute_dtype,
                                                          device=device) for _ in range(n_slots)]
                            for name in kv}
        self.read_buffer = {} if dtype == self.compute_dtype else {
            name: torch.empty(shape, dtype=self.compute_dtype, device=device) for name in kv}
        self.length = 0

    def update(self, slot, input_pos, k, v=None, read=None):
        """Write k (B, n_kv_head, T, key_dim) and v at positions input_pos (T,) of the first B rows
        (a batch smaller than the cache uses those). Return the K and V attention reads, as stored
        and in compute_dtype: every slot (at `positions(input_pos)`), or the first `read` slots
        (positions 0 .. read - 1), or when those are just the T written (a prefill) the T as written,
        which a ring longer than its window keeps only the last max_len of. A ring takes one position
        at a time after its prefill."""
        slots = input_pos % self.max_len if self.ring else input_pos           # (T,)
        keys = self.write(slot, "k", slots, k, read)
        if self.value_dim_in_keys:
            return keys, keys[..., :self.value_dim_in_keys]
        return keys, self.write(slot, "v", slots, v, read)

    def write(self, slot, name, slots, x, read):
        """Store x (B, heads, T, dim) at `slots`; return what attention reads (see update)."""
        last = slice(-self.max_len, None)  # all T of a plain cache, the last max_len of a ring
        stored = self.stored[name][slot][:x.size(0)]                           # (B, heads, max_len, dim)
        scale = scales = None
        if self.quantized:
            x, scale = quantize_rows(x)                                        # (B, heads, T, dim), (.., 1)
            scale = scale.to(self.compute_dtype)
            scales = self.stored[f"{name}_scale"][slot][:x.size(0)]            # (B, heads, max_len, 1)
            scales.index_copy_(2, slots[last], scale[:, :, last])
        else:
            x = x.to(self.dtype)
        stored.index_copy_(2, slots[last], x[:, :, last])
        if read == x.size(2):
            return x.to(self.compute_dtype) if scale is None else x.to(self.compute_dtype) * scale
        stored = stored[:, :, :read]                                           # (B, heads, read, dim)
        if not self.read_buffer:
            return stored
        buffer = self.read_buffer[name][:x.size(0), :, :read].copy_(stored)    # (B, heads, read, dim)
        return buffer if scales is None else buffer.mul_(scales[:, :, :read])

    def positions(self, input_pos) -> torch.Tensor:
        """(max_len,) the position each slot holds once input_pos (T,) is written: the slot itself,
        or in a ring the latest position that falls on it (negative: none has yet)."""
        slots = torch.arange(self.max_len, device=input_pos.device)
        if not self.ring:
            return slots
        last = input_pos[-1]
        return last - (last - slots) % self.max_len

    def advance(self, n: int) -> None:
        """Count n more positions as written; callers check for room, so overflowing is a bug."""
        if not self.ring and self.length + n > self.max_len:
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
        """The tensors that hold the cache's memory: every K, every V that is not inside its K, and
        an int8 cache's scales."""
        return [t for tensors in self.stored.values() for t in tensors]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.buffers)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one position of one sequence takes across all slots, scales included
        (GPTConfig.kv_cache_formula)."""
        return self.nbytes // (self.batch_size * self.max_len)
