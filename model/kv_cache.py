"""A static, preallocated key/value cache: fixed shapes, written in place, never grown. It stores
in float32, bfloat16 or int8 (one scale per position and head), and for a sliding-window model it
is a ring of window slots that position p overwrites at slot p % window."""

import copy
from typing import NamedTuple

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


class Quantized(NamedTuple):
    """What an int8 cache hands a one-token step: the rows as stored, int8 (B, heads, S, dim), and
    their scales (B, heads, S, 1). Attention reads them so (attention.attend_quantized), in one pass
    over the int8 numbers, instead of a float copy of the cache."""

    values: torch.Tensor
    scales: torch.Tensor


class KVCache:
    """Per slot (one layer, or one group of `GPTConfig.kv_share` layers), K and V of shape
    (B, n_kv_head, slot length, key_dim) in `dtype`, handed to attention in `compute_dtype`. With
    dtype int8, each position of each head has a scale (B, n_kv_head, slot length, 1) in compute_dtype.
    With `value_dim_in_keys=L`, each V is K's first L columns (MLA caches one latent that serves as
    both), so only K takes memory.

    `windows` gives each slot's window (None: its layers see the whole context). A windowed slot is
    a ring of sinks + window slots when positions may outrun it: when its window plus `sinks` fits
    in max_len, or when every slot has a window that max_len reaches (then nothing bounds the
    positions but the caller: the ring takes them without end, its sinks too, even where sinks +
    window exceed max_len). In a ring, `sinks` slots keep each row's first positions forever
    (StreamingLLM), then position p overwrites slot sinks + p % window. Every other slot holds
    max_len positions, position p in slot p. Only the cache moves `length`
    (the positions written); slots past it hold stale values the mask hides, so shapes never change
    and decode can be compiled. Storing in another dtype, it keeps one slot's K and V in
    compute_dtype too (`read_buffer`), into which each layer converts its own: much faster than a
    fresh tensor; a one-token step of an int8 cache reads it as stored instead (`Quantized`)."""

    def __init__(self, windows, batch_size, n_kv_head, max_len, key_dim, *, sinks=0, value_dim_in_keys=0,
                 dtype=torch.float32, compute_dtype=None, device=None):
        self.windows, self.sinks = list(windows), sinks
        endless = all(w is not None and max_len >= w for w in self.windows)
        self.rings = [w is not None and (endless or max_len >= sinks + w) for w in self.windows]
        self.slot_lens = [sinks + w if ring else max_len for w, ring in zip(self.windows, self.rings)]
        self.ring = all(self.rings)  # only rings: the cache is never full
        dtype = storage_dtype(dtype)
        self.quantized = dtype == torch.int8
        compute_dtype = compute_dtype or (torch.float32 if self.quantized else dtype)
        if compute_dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise ValueError(f"compute_dtype must be a floating-point dtype, got {compute_dtype!r}")
        self.dtype, self.compute_dtype = dtype, compute_dtype
        self.value_dim_in_keys = value_dim_in_keys
        self.batch_size, self.max_len = batch_size, max(self.slot_lens)
        kv = ["k"] if value_dim_in_keys else ["k", "v"]
        shapes = {name: [(batch_size, n_kv_head, n, key_dim) for n in self.slot_lens] for name in kv}
        if self.quantized:
            shapes |= {f"{name}_scale": [(batch_size, n_kv_head, n, 1) for n in self.slot_lens]
                       for name in kv}
        self.stored = {name: [torch.zeros(shape, device=device,
                                          dtype=self.compute_dtype if name.endswith("_scale") else dtype)
                              for shape in slot_shapes] for name, slot_shapes in shapes.items()}
        self.read_buffer = {} if dtype == self.compute_dtype else {
            name: torch.empty(batch_size, n_kv_head, self.max_len, key_dim, dtype=self.compute_dtype,
                              device=device) for name in kv}
        self.length = 0
        # A dict while an inspector records (recorder.DecodeRecorder): each store of an int8 cache puts
        # there, under (slot, name), how far what it stored is from what it was given.
        self.errors = None

    def update(self, slot, input_pos, k, v=None, read=None, pad=None):
        """Write k (B, n_kv_head, T, key_dim) and v at positions input_pos (T,) of the first B rows
        (a batch smaller than the cache uses those; `pad` (B,) shifts each row's sink positions).
        Return the K and V attention reads, as stored and in compute_dtype, laid out as
        `key_positions` says."""
        keys = self.write(slot, "k", input_pos, k, read, pad)
        if self.value_dim_in_keys:  # V is inside K: the caller keeps the first columns of its output
            return keys, keys
        return keys, self.write(slot, "v", input_pos, v, read, pad)

    def write(self, slot, name, input_pos, x, read, pad):
        """Store x (B, heads, T, dim) at input_pos; return what attention reads (see key_positions)."""
        T, ring = x.size(2), self.rings[slot]
        if not (ring or self.quantized or self.read_buffer):  # the plain cache: position p in cell p
            stored = self.first_rows(name, slot, x.size(0))[0]                 # (B, heads, max_len, dim)
            x = x if x.dtype == self.dtype else x.to(self.dtype)
            stored.index_copy_(2, input_pos, x)
            return x if read == T else stored[:, :, :read]                     # (B, heads, T or read, dim)
        stored, scales = self.first_rows(name, slot, x.size(0))               # (B, heads, slot length, .)
        old = None
        if self.reads_before_writing(slot, T, read):  # a copy: the store below overwrites slots of it
            old = self.read(name, stored, scales, stored.size(2))
            old = old if self.read_buffer else old.clone()
        new = self.store(slot, name, input_pos, x, pad)                        # as the cache will read it
        if old is not None:
            return torch.cat([old, new], dim=2)                                # (B, heads, slots + T, dim)
        if read == T:
            return new                                                         # (B, heads, T, dim)
        n = stored.size(2) if read is None or ring else read
        if self.quantized and T == 1:
            return Quantized(stored[:, :, :n], scales[:, :, :n])
        return self.read(name, stored, scales, n)

    def store(self, slot, name, input_pos, x, pad=None) -> torch.Tensor:
        """Store x (B, heads, T, dim) at positions input_pos (T,): a ring keeps the last `window` of
        them and each row's first `sinks`. Returns x as the cache reads it back, in compute_dtype."""
        if self.quantized:
            given = x
            x, scale = quantize_rows(x)                                        # (B, heads, T, dim), (.., 1)
            scale = scale.to(self.compute_dtype)
            new = x.to(self.compute_dtype) * scale
            if self.errors is not None:  # relative: |stored - given| / |given|, over the rows written
                given = given.float()
                self.errors[slot, name] = (new.float() - given).norm() / given.norm().clamp(min=1e-30)
        else:  # (a conversion to the dtype a tensor has still costs a CPU decode step ~1 µs a call)
            x, scale = (x if x.dtype == self.dtype else x.to(self.dtype)), None
            new = x if x.dtype == self.compute_dtype else x.to(self.compute_dtype)
        self.place(slot, name, input_pos, x, scale, pad)
        return new

    def place(self, slot, name, input_pos, x, scale=None, pad=None) -> None:
        """Put x (B, heads, T, dim), already in the stored dtype (int8: with its scale (.., 1)), at
        the slots positions input_pos (T,) go to."""
        stored, scales = self.first_rows(name, slot, x.size(0))               # (B, heads, slot length, .)
        slots = input_pos
        if self.rings[slot]:  # the last `window` positions, each in its slot; the sinks in theirs
            window = self.windows[slot]
            self.write_sinks(stored, scales, input_pos, x, scale, pad)
            slots, x = self.sinks + input_pos[-window:] % window, x[:, :, -window:]  # (<= window,) slots
            scale = None if scale is None else scale[:, :, -window:]
        stored.index_copy_(2, slots, x)
        if scales is not None:
            scales.index_copy_(2, slots, scale)

    def first_rows(self, name, slot, rows: int):
        """Slot `slot`'s stored `name` and, int8, its scales (None otherwise), each cut to the first
        `rows` rows: the tensors themselves when that is all of them (a view costs a CPU decode step
        ~2 µs, four a layer)."""
        stored = self.stored[name][slot]                                       # (batch_size, heads, ., dim)
        scales = self.stored[f"{name}_scale"][slot] if self.quantized else None  # (batch_size, heads, ., 1)
        if rows == self.batch_size:
            return stored, scales
        return stored[:rows], None if scales is None else scales[:rows]

    def fill_from(self, prefix: "KVCache", rows: int, pad=None) -> None:
        """Every row as if it had been fed positions 0 .. prefix.length - 1, row b's position p at
        column pad[b] + p: a prompt prefix shared by every row, computed once (in `prefix`, one row
        of plain slots stored in this cache's dtype, so that every layer after the first read the
        keys a row alone reads) and copied, as stored, into each of the first `rows`. Columns before
        a row's pad get its position 0 again, which the mask hides as padding."""
        if prefix.dtype != self.dtype or any(prefix.rings):
            raise ValueError(f"the prefix must be plain slots stored in {self.dtype}, got {prefix.dtype}")
        n = prefix.length
        columns = torch.arange(n, device=prefix.stored["k"][0].device)
        source = columns if pad is None else (columns - pad[:, None]).clamp(min=0)  # (n,) or (B, n)
        source = source.expand(rows, n) if pad is None else source               # (B, n)

        def each_row(stored):                                                  # (1, heads, >= n, dim)
            return stored[0, :, :n][:, source].transpose(0, 1)                 # (B, heads, n, dim)

        for name in ["k", "v"][:1 if self.value_dim_in_keys else 2]:
            for slot, kv in enumerate(prefix.stored[name]):
                scale = each_row(prefix.stored[f"{name}_scale"][slot]) if self.quantized else None
                self.place(slot, name, columns, each_row(kv), scale, pad)
        self.length = n

    def read(self, name, stored, scales, n):
        """The first n slots of `stored` in compute_dtype (B, heads, n, dim), scaled if int8."""
        stored = stored[:, :, :n]
        if not self.read_buffer:
            return stored
        buffer = self.read_buffer[name][:stored.size(0), :, :n].copy_(stored)  # (B, heads, n, dim)
        return buffer if scales is None else buffer.mul_(scales[:, :, :n])

    def write_sinks(self, stored, scales, input_pos, x, scale, pad):
        """Keep each row's positions 0 .. sinks-1 (counted from its first token, after `pad`) in the
        ring's first slots, whichever columns they are written at: a fixed-shape `where` per sink."""
        rows = torch.arange(x.size(0), device=x.device)
        row_pos = (input_pos - (0 if pad is None else pad[:, None])).expand(x.size(0), -1)  # (B, T)
        for s in range(self.sinks):
            at = row_pos == s                                                  # (B, T): at most one per row
            t, written = at.int().argmax(dim=1), at.any(dim=1)[:, None, None]  # (B,), (B, 1, 1)
            stored[:, :, s] = torch.where(written, x[rows, :, t], stored[:, :, s])
            if scales is not None:
                scales[:, :, s] = torch.where(written, scale[rows, :, t], scales[:, :, s])

    def reads_before_writing(self, slot, T, read) -> bool:
        """A chunk of T > 1 positions into a ring that holds earlier ones: its queries need keys the
        chunk overwrites, so attention reads the ring as it was, then the chunk."""
        return self.rings[slot] and T > 1 and read is not None and read > T

    def key_positions(self, slot, input_pos, read, pad=None) -> torch.Tensor | None:
        """The position each key that slot `slot`'s attention reads holds, (S,) or (B, S) with
        `pad`, -1 where none is to be seen; or None when the keys are positions 0 .. S-1 in order
        (S = read), which a causal mask (bottom-right) describes. A plain slot reads its first `read`
        slots (None: every slot, by position: the compiled step's fixed shape). A ring reads the T
        new positions as written when it was empty (read == T), every slot after writing one
        position, or (reads_before_writing) every slot as it was followed by the T new. A ring slot
        holding a sink position hides it: its sink slot shows it."""
        T = input_pos.size(0)
        if read is not None and (read == T or not self.rings[slot]):
            return None
        if not self.rings[slot]:
            return torch.arange(self.slot_lens[slot], device=input_pos.device)
        if not self.reads_before_writing(slot, T, read):
            return self.ring_positions(self.windows[slot], input_pos[-1] + 1, pad)
        return torch.cat([self.ring_positions(self.windows[slot], input_pos[0], pad),
                          input_pos.expand(*(() if pad is None else (pad.size(0),)), T)], dim=-1)

    def ring_positions(self, window, end, pad):
        """(sinks + window,) or with pad (B, sinks + window): the positions a ring holds once positions
        0 .. end-1 (end: a tensor) are written, -1 for a slot not written yet and for a sink position
        in the ring (its sink slot holds it)."""
        last = end - 1
        ring = last - (last - torch.arange(window, device=end.device)) % window  # (window,)
        if pad is not None:
            ring = ring.expand(pad.size(0), window)                            # (B, window)
        row_start = 0 if pad is None else pad[:, None]                         # each row's position 0
        row_pos = ring - row_start                                             # below 0: a pad
        ring = ring.masked_fill((ring < 0) | ((row_pos >= 0) & (row_pos < self.sinks)), -1)
        sinks = row_start + torch.arange(self.sinks, device=end.device)        # (sinks,) or (B, sinks)
        return torch.cat([sinks.masked_fill(sinks > last, -1), ring], dim=-1)

    def advance(self, n: int) -> None:
        """Count n more positions as written; callers check for room, so overflowing is a bug."""
        if not self.ring and self.length + n > self.max_len:
            raise RuntimeError(f"{self.length + n} positions exceed the cache size {self.max_len}")
        self.length += n

    def reset(self) -> None:
        self.length = 0

    def over(self, tensors) -> "KVCache":
        """This cache with its memory in `tensors` instead, listed as `tensors` lists its own: what
        a step traced by torch.export reads and writes, its inputs."""
        view, given = copy.copy(self), iter(tensors)
        view.stored = {name: [next(given) for _ in slots] for name, slots in self.stored.items()}
        view.read_buffer = {name: next(given) for name in self.read_buffer}
        return view

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache writes: its `buffers`, then the read buffer's."""
        return [*self.buffers, *self.read_buffer.values()]

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
        (GPTConfig.kv_cache_formula); with rings shorter than max_len, the average over max_len."""
        return self.nbytes // (self.batch_size * self.max_len)
