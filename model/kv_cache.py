"""The full KV cache, what the variants add to the core's plain one (model/core/kv_cache.py): a
cache per group of layers, rings, storage kinds and rows of different lengths. Preallocated,
written in place, never grown: shapes never change, and a decode step can be compiled.

Read top to bottom: `GroupCache` is the plain cache of one group of layers (position p in cell p);
`Stored` is how it keeps K or V. Each extension is a piece of its own, along one of two axes:
where a position goes (`Ring`: a sliding window's last positions and its sinks, in a ring of cells)
and how it is stored (`Converted`: in another dtype than attention computes in; `Int8`: int8 with
one scale per position and head; `Int4`: int4 in groups of numbers, with the last positions also
in full precision). `KVCache` holds one group cache per group, for the whole model.
"""

import copy
from typing import NamedTuple

import torch

from model.core.config import is_integer

KV_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.int8}  # what a cache stores


class GroupCache:
    """The plain KV cache of one group of layers (a layer, or a `GPTConfig.kv_share` group, whose
    later layers attend over its first layer's K/V): K and V of shape (rows, heads, cells, dim),
    position p in cell p. `v` None: V is inside K (MLA's one latent serves as both)."""

    ring = False

    def __init__(self, k: "Stored", v: "Stored | None"):
        self.k, self.v, self.cells = k, v, k.cells

    def update(self, input_pos, k, v=None, cells_read=None, starts=None):
        """Write k and v (B, heads, T, dim) at positions input_pos (T,) of the first B rows; return
        the K and V attention reads: what was given, into an empty cache (cells_read == T), else the
        first `cells_read` cells (None: every cell, the compiled step's fixed shape)."""
        keys = self.write(self.k, input_pos, k, cells_read, starts)
        return keys, keys if self.v is None else self.write(self.v, input_pos, v, cells_read, starts)

    def write(self, stored, input_pos, x, cells_read, starts):
        """Store x (B, heads, T, dim) at input_pos; return what attention reads of `stored`."""
        parts, new = stored.encode(x)                                    # as kept; as read back
        stored.place(input_pos, parts)                                   # position p in cell p
        T = x.size(2)
        if cells_read == T:
            return new
        return stored.read(x.size(0), self.cells if cells_read is None else cells_read, T == 1)

    def place(self, stored, input_pos, parts, starts=None) -> None:
        """Put parts (B, heads, T, .), x as `stored` keeps it (`Stored.encode`), at input_pos."""
        stored.place(input_pos, parts)

    def key_positions(self, input_pos, cells_read, starts=None) -> torch.Tensor | None:
        """The position each key attention reads holds, (S,): None where the first `cells_read` cells are
        positions 0 .. cells_read-1 in order (a causal mask describes them); every cell by position when
        cells_read is None."""
        return None if cells_read is not None else torch.arange(self.cells, device=input_pos.device)


class Stored:
    """K or V of one group as the plain cache keeps it: one tensor (rows, heads, cells, dim) in the
    dtype attention computes in. `encode` gives x as kept and as attention reads it back, `place`
    writes cells, `read` the first n cells of the first rows, a view of the cache's own memory. (A
    batch smaller than the cache uses its first rows.)"""

    def __init__(self, rows, heads, cells, dim, dtype, device):
        self.tensors = [torch.zeros(rows, heads, cells, dim, dtype=dtype, device=device)]
        self.batch_size, self.cells, self.dtype = rows, cells, dtype

    def encode(self, x) -> tuple[list[torch.Tensor], torch.Tensor]:
        """([each tensor's part of x, as kept], x as read back): what a `Ring` places itself."""
        x = x if x.dtype == self.dtype else x.to(self.dtype)  # (a no-op .to still costs ~1 µs)
        return [x], x

    def place(self, at, parts) -> None:
        """Put `encode`'s parts (B, heads, T, .) in cells `at` (T,)."""
        for tensor, part in zip(self.rows(parts[0].size(0)), parts):
            tensor.index_copy_(2, at, part)

    def read(self, rows, n, one_query=False) -> torch.Tensor:
        return self.rows(rows)[0][:, :, :n]                              # (rows, heads, n, dim)

    def rows(self, rows: int) -> list[torch.Tensor]:
        """The tensors cut to their first `rows` rows: themselves when that is all of them (a view
        costs a CPU decode step ~2 µs, four a layer)."""
        return self.tensors if rows == self.batch_size else [t[:rows] for t in self.tensors]


# ----------------------------------------------------------------------------- how it is stored

class Converted(Stored):
    """Kept in `dtype` (bfloat16, say), read in compute_dtype: each layer converts the cells it reads
    into `buffer`, one tensor every group shares (much faster than a fresh tensor a layer)."""

    def __init__(self, rows, heads, cells, dim, dtype, device, compute_dtype, buffer):
        super().__init__(rows, heads, cells, dim, dtype, device)
        self.compute_dtype, self.buffer = compute_dtype, buffer

    def encode(self, x):
        (x,), _ = super().encode(x)
        return [x], self.read_back(x)

    def read_back(self, x):
        return x if x.dtype == self.compute_dtype else x.to(self.compute_dtype)

    def read(self, rows, n, one_query=False):
        return self.buffer[:rows, :, :n].copy_(super().read(rows, n))  # (rows, heads, n, dim)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) -> (int8 (..., D), scale (..., 1) in float32): symmetric absmax, one scale per
    row, so x ~ int8 * scale with an error of at most scale / 2 per number."""
    scale = x.float().abs().amax(dim=-1, keepdim=True) / 127                 # (..., 1)
    q = (x.float() / scale.clamp(min=torch.finfo(torch.float32).tiny)).round().clamp(-127, 127)
    return q.to(torch.int8), scale


class Quantized(NamedTuple):
    """What an int8 cache hands a one-token step: the rows as stored, int8 (B, heads, S, dim), and
    their scales (B, heads, S, 1). Attention reads them so (kernels.attend_quantized), in one pass
    over the int8 numbers, instead of a float copy of the cache."""

    values: torch.Tensor
    scales: torch.Tensor
    may_compile: bool = True  # False: attention reads them as written (Int8.may_compile)


class Int8(Converted):
    """Kept as int8 numbers with one scale per position and head (quantize_rows), in compute_dtype:
    a quarter of float32's bytes, plus the scales. A one-token step reads them as stored
    (`Quantized`); a longer pass reads them scaled into the buffer. While `keep_error` is set (the
    inspect page's recorder), `error` says how far the last rows written are from those given."""

    keep_error = False
    may_compile = True  # False: a decode too short for attention's compiled kernel to pay (set by stream)

    def __init__(self, rows, heads, cells, dim, dtype, device, compute_dtype, buffer):
        super().__init__(rows, heads, cells, dim, dtype, device, compute_dtype, buffer)
        self.tensors.append(torch.zeros(rows, heads, cells, 1, dtype=compute_dtype, device=device))
        self.error = None

    def encode(self, x):
        q, scale = quantize_rows(x)                                      # (B, heads, T, dim), (.., 1)
        scale = scale.to(self.compute_dtype)
        new = q.to(self.compute_dtype) * scale
        if self.keep_error:  # relative: |stored - given| / |given|, over the rows written
            given = x.float()
            self.error = (new.float() - given).norm() / given.norm().clamp(min=1e-30)
        return [q, scale], new

    def read(self, rows, n, one_query=False):
        values, scales = (t[:, :, :n] for t in self.rows(rows))          # (rows, heads, n, dim), (.., 1)
        if one_query:
            return Quantized(values, scales, self.may_compile)
        return self.buffer[:rows, :, :n].copy_(values).mul_(scales)


def quantize_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) -> (uint8 (..., D/2), scales (..., D/group) in float32): symmetric absmax per group
    of `group` numbers, scale = absmax / 7, q = round(x / scale) in -7..7, so x ~ q * scale with an
    error of at most scale / 2 per number; two q a byte (pack_int4)."""
    groups = x.float().unflatten(-1, (-1, group))                           # (..., D/G, G)
    scale = groups.abs().amax(dim=-1, keepdim=True) / 7                     # (..., D/G, 1)
    q = (groups / scale.clamp(min=torch.finfo(torch.float32).tiny)).round().clamp(-7, 7)
    return pack_int4(q.flatten(-2)), scale[..., 0]                          # (..., D/2), (..., D/G)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Integers (..., D) in -8..7 -> uint8 (..., D/2): number 2i, plus 8, in byte i's low half, number
    2i + 1, plus 8, in its high half."""
    q = q.to(torch.int16) + 8                                               # (..., D) in 0..15
    return (q[..., 0::2] | (q[..., 1::2] << 4)).to(torch.uint8)            # (..., D/2)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """pack_int4 undone: uint8 (..., D/2) -> int8 (..., D) in -8..7."""
    halves = torch.stack([packed & 15, packed >> 4], dim=-1)               # (..., D/2, 2)
    return halves.flatten(-2).to(torch.int8) - 8                            # (..., D)


def dequantize_groups(packed: torch.Tensor, scales: torch.Tensor, out=None) -> torch.Tensor:
    """quantize_groups undone: uint8 (..., D/2) and scales (..., D/G) -> q * scale (..., D) in the
    scales' dtype, written into `out` (..., D) if given (a view of a read buffer, say)."""
    if out is None:
        out = scales.new_empty(*packed.shape[:-1], 2 * packed.size(-1))    # (..., D)
    halves = out.view(*packed.shape, 2)                                     # (..., D/2, 2)
    halves[..., 0].copy_(packed & 15)  # (unpack_int4's numbers, plus 8, converted as they are copied)
    halves[..., 1].copy_(packed >> 4)
    out.view(*scales.shape, -1).sub_(8).mul_(scales.unsqueeze(-1))          # (..., D/G, G)
    return out


class MixedKeys(NamedTuple):
    """What an int4 cache hands a chunk of T > 1 queries, the last T of positions 0 .. cells - 1:
    `old`, cells 0 .. d-1 dequantized (B, heads, d, dim), and `recent`, positions start .. cells - 1
    in full precision (B, heads, cells - start, dim): the ring's from before the chunk, then the
    chunk's own. The query at i reads position j from `recent` if i - j < within, else from `old`
    (`visible`); attention takes them side by side (model/attention.py, int4_chunk)."""

    old: torch.Tensor
    recent: torch.Tensor
    start: int
    within: int

    @property
    def cells(self) -> int:
        return self.start + self.recent.size(2)

    def visible(self, T: int, mask=None) -> torch.Tensor:
        """Which of [old, recent]'s d + cells - start keys each query reads: (T, .), or with `mask` (bool
        over the cells, broadcasting to (B, heads, T, cells)) and-ed in, (B or 1, heads or 1, T, .)."""
        n, d, device = self.cells, self.old.size(2), self.old.device
        query = torch.arange(n - T, n, device=device)[:, None]              # (T, 1)
        old, recent = torch.arange(d, device=device), torch.arange(self.start, n, device=device)
        rule = torch.cat([query - old >= self.within,                        # (T, d): causal too
                          (recent <= query) & (query - recent < self.within)], dim=1)  # (T, d + n - start)
        if mask is None:
            return rule
        mask = mask.reshape((1,) * (4 - mask.dim()) + mask.shape).expand(-1, -1, T, n)  # (B or 1, ., T, n)
        return rule & torch.cat([mask[..., :d], mask[..., self.start:]], dim=-1)

    def per_cell(self, weights: torch.Tensor) -> torch.Tensor:
        """Attention weights over [old, recent] (..., T, d + cells - start) as weights over the cells
        (..., T, cells): each (query, position) is read from one of the two, the other's weight is 0."""
        d, n = self.old.size(2), self.cells
        cells = weights.new_zeros(*weights.shape[:-1], n)                    # (..., T, cells)
        cells[..., :d] += weights[..., :d]
        cells[..., self.start:] += weights[..., d:]
        return cells


class Int4(Stored):
    """Kept as int4 numbers, two a byte, with one scale (in compute_dtype) per group of `group`
    numbers of a position and head (quantize_groups), and the last `recent` positions also as given,
    in compute_dtype, in a ring (position p in cell p % recent): KIVI's full-precision window, a
    query reading positions less than `recent` before it as given, older ones as int4. A one-token
    step reads the cache so in `buffer`; a chunk reads each position as each query needs
    (`MixedKeys`), so a prompt gives the same logits however it is fed."""

    def __init__(self, rows, heads, cells, dim, device, compute_dtype, buffer, recent: int, group: int):
        kept = [((cells, dim // 2), torch.uint8), ((cells, dim // group), compute_dtype),
                ((recent, dim), compute_dtype)]                              # packed, scales, ring
        self.tensors = [torch.zeros(rows, heads, *shape, dtype=dtype, device=device) for shape, dtype in kept]
        self.batch_size, self.cells, self.dtype, self.compute_dtype = rows, cells, "int4", compute_dtype
        self.buffer, self.recent, self.group = buffer, recent, group

    def encode(self, x):
        x = x if x.dtype == self.compute_dtype else x.to(self.compute_dtype)
        packed, scales = quantize_groups(x, self.group)                     # (B, heads, T, D/2), (.., D/G)
        return [packed, scales.to(self.compute_dtype), x], x

    def place(self, at, parts) -> None:
        """Every position in its cell as int4, the last `recent` also in their ring cells."""
        packed, scales, ring = self.rows(parts[0].size(0))
        packed.index_copy_(2, at, parts[0])
        scales.index_copy_(2, at, parts[1])
        if self.recent:
            ring.index_copy_(2, at[-self.recent:] % self.recent, parts[2][:, :, -self.recent:])

    def write(self, at, x, cells_read):
        """Store x (B, heads, T, dim) at positions `at`, the last T of 0 .. cells_read - 1; return what
        its queries read: one query, `read`; a chunk, the given keys where every query reads every
        position as given, the dequantized cells where none does (recent 0), else `MixedKeys`."""
        if cells_read is None:
            raise ValueError("an int4 cache is read up to its last position (cells_read), not every cell")
        B, T, n, R = x.size(0), x.size(2), cells_read, self.recent
        old = max(0, n - R)  # cells 0 .. old-1: those the last query reads as int4
        start = max(0, n - T - R + 1)  # the first position a query of the chunk reads as given
        parts, x = self.encode(x)
        if T > 1 and old and R:  # the ring's positions before the chunk, before it overwrites them
            recent = torch.cat([*self.ring_slices(self.rows(B)[2], start, n - T), x], dim=2)
        self.place(at, parts)
        if T == 1:
            return self.read(B, n)
        if not old:  # positions 0 .. n-1 all in the ring, in order
            return x if n == T else self.rows(B)[2][:, :, :n]
        packed, scales, _ = self.rows(B)
        old_keys = dequantize_groups(packed[:, :, :old], scales[:, :, :old], self.buffer[:B, :, :old])
        return MixedKeys(old_keys, recent, start, R) if R else old_keys

    def read(self, rows, n, one_query=True):
        """Cells 0 .. n-1 as the query at position n - 1 reads them, in the buffer (rows, heads, n, dim):
        the last min(recent, n) as given, from the ring, the others dequantized."""
        given = min(self.recent, n)
        out = self.buffer[:rows, :, :n]                                     # (rows, heads, n, dim)
        packed, scales, ring = self.rows(rows)
        if n > given:
            dequantize_groups(packed[:, :, :n - given], scales[:, :, :n - given], out[:, :, :n - given])
        at = n - given
        for part in self.ring_slices(ring, n - given, n):
            out[:, :, at:at + part.size(2)].copy_(part)
            at += part.size(2)
        return out

    def ring_slices(self, ring, first: int, end: int) -> list[torch.Tensor]:
        """Positions first .. end-1 (at most `recent`) of the ring (rows, heads, recent, dim), in order:
        at most two slices, (rows, heads, ., dim) each."""
        count = end - first
        if count <= 0:
            return []
        cell = first % self.recent
        head = ring[:, :, cell:min(self.recent, cell + count)]                # (rows, heads, ., dim)
        rest = count - head.size(2)
        return [head, ring[:, :, :rest]] if rest else [head]


class Int4Group(GroupCache):
    """The plain cache of a group stored as `Int4`, whose queries choose between a position's two
    copies: the storage itself says what they read (Int4.write)."""

    def write(self, stored, input_pos, x, cells_read, starts):
        return stored.write(input_pos, x, cells_read)


# ----------------------------------------------------------------------------- where a position goes

class Ring(GroupCache):
    """A sliding window's cache: `sinks` cells keep each row's first positions forever (StreamingLLM),
    then position p overwrites cell sinks + p % window, so positions never run out. It alone knows
    which position each cell holds (`key_positions`); attention reads every cell."""

    ring = True

    def __init__(self, k, v, window: int, sinks: int):
        super().__init__(k, v)
        self.window, self.sinks = window, sinks

    def write(self, stored, input_pos, x, cells_read, starts):
        T, old = x.size(2), None
        if self.reads_before_writing(T, cells_read):  # a copy: the chunk overwrites cells of it
            old = stored.read(x.size(0), self.cells)                      # a converted copy, or a view:
            old = old if isinstance(stored, Converted) else old.clone()
        parts, new = stored.encode(x)                                      # as kept; as read back
        self.place(stored, input_pos, parts, starts)
        if old is not None:
            return torch.cat([old, new], dim=2)                            # (B, heads, cells + T, dim)
        return new if cells_read == T else stored.read(x.size(0), self.cells, T == 1)

    def place(self, stored, input_pos, parts, starts=None) -> None:
        """The last `window` positions, each in its cell; each row's sinks in theirs."""
        if self.sinks:
            self.write_sinks(stored, input_pos, parts, starts)
        at = self.sinks + input_pos[-self.window:] % self.window             # (<= window,) cells
        stored.place(at, [part[:, :, -self.window:] for part in parts])

    def write_sinks(self, stored, input_pos, parts, starts):
        """Keep each row's positions 0 .. sinks-1 (counted from its first token, after `starts`) in the
        first cells, whichever columns they are written at: a fixed-shape `where` per sink."""
        B = parts[0].size(0)
        rows = torch.arange(B, device=input_pos.device)
        row_pos = (input_pos - (0 if starts is None else starts[:, None])).expand(B, -1)  # (B, T)
        for s in range(self.sinks):
            at = row_pos == s                                              # (B, T): at most one per row
            t, written = at.int().argmax(dim=1), at.any(dim=1)[:, None, None]  # (B,), (B, 1, 1)
            for tensor, part in zip(stored.rows(B), parts):
                tensor[:, :, s] = torch.where(written, part[rows, :, t], tensor[:, :, s])

    def reads_before_writing(self, T, cells_read) -> bool:
        """A chunk of T > 1 positions into a ring that holds earlier ones: its queries need keys the
        chunk overwrites, so attention reads the ring as it was, then the chunk."""
        return T > 1 and cells_read is not None and cells_read > T

    def key_positions(self, input_pos, cells_read, starts=None) -> torch.Tensor | None:
        """(S,) or (B, S) with `starts`: the T new positions as written into an empty ring (cells_read == T:
        None), every cell after writing one position, or every cell as it was followed by the T new
        (reads_before_writing). -1 where a cell is to be hidden."""
        T = input_pos.size(0)
        if cells_read == T:
            return None
        if not self.reads_before_writing(T, cells_read):
            return self.positions(input_pos[-1] + 1, starts)
        return torch.cat([self.positions(input_pos[0], starts),
                          input_pos.expand(*(() if starts is None else (starts.size(0),)), T)], dim=-1)

    def positions(self, end, starts):
        """(sinks + window,) or with starts (B, sinks + window): the position each cell holds once
        positions 0 .. end-1 (end: a tensor) are written, -1 for a cell not written yet and for a
        ring cell holding a sink position (its sink cell shows it)."""
        last = end - 1
        ring = last - (last - torch.arange(self.window, device=end.device)) % self.window  # (window,)
        if starts is not None:
            ring = ring.expand(starts.size(0), self.window)                   # (B, window)
        row_start = 0 if starts is None else starts[:, None]                     # each row's position 0
        row_pos = ring - row_start                                         # below 0: padding
        ring = ring.masked_fill((ring < 0) | ((row_pos >= 0) & (row_pos < self.sinks)), -1)
        sinks = row_start + torch.arange(self.sinks, device=end.device)    # (sinks,) or (B, sinks)
        return torch.cat([sinks.masked_fill(sinks > last, -1), ring], dim=-1)


# ----------------------------------------------------------------------------- the whole model's

def storage_dtype(dtype, name: str = "dtype") -> torch.dtype:
    """The dtype a cache stores in, given as one of KV_DTYPES' dtypes or names; anything else (an
    integer dtype would truncate keys and values) is a ValueError naming the argument `name`."""
    dtype = KV_DTYPES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if not isinstance(dtype, torch.dtype) or dtype not in KV_DTYPES.values():
        raise ValueError(f"{name} must be one of {', '.join(KV_DTYPES)} (a torch dtype or its name), "
                         f"got {dtype!r}")
    return dtype


def is_int4(dtype) -> bool:
    """Whether `dtype` asks for an int4 cache: the name "int4" (torch has no int4 dtype to give)."""
    return isinstance(dtype, str) and dtype == "int4"


def check_int4(recent, group, key_dim: int, rings: bool) -> None:
    """An int4 cache's options, or a ValueError naming the one that is wrong: `recent` an integer
    from 0 (every position int4), `group` an even integer from 2 dividing the key width; no rings."""
    if not is_integer(recent) or recent < 0:
        raise ValueError(f"int4_recent must be an integer >= 0, got {recent!r}")
    if not is_integer(group) or group < 2 or group % 2 or key_dim % group:
        raise ValueError(f"int4_group must be an even integer >= 2 dividing the key width {key_dim}, "
                         f"got {group!r}")
    if rings:
        raise ValueError("an int4 cache holds every position, and windowed layers keep theirs in rings: "
                         "build it with ring=False, or in another dtype")


def layout(windows, n_kv_head: int, key_dim: int, value_dim_in_keys: int, sinks: int) -> tuple:
    """What a model checks a cache it is handed against (GPT.forward): its groups, their windows and
    sinks, their K/V heads and widths."""
    return tuple(windows), n_kv_head, key_dim, value_dim_in_keys, sinks


class KVCache:
    """The model's cache: one group cache per group (`groups`), K of shape (B, n_kv_head, cells,
    key_dim) and V alike (`value_dim_in_keys=L`: each V is K's first L columns, MLA's latent), stored
    in `dtype` ("int4": `Int4`, the last int4_recent positions also as given, in groups of int4_group
    numbers), handed to attention in `compute_dtype`. `windows` gives each group's window (None:
    its layers see the whole context). A windowed group is a `Ring` of sinks + window cells when
    positions may outrun it: when sinks + window fit in max_len, or when every group has a window
    that max_len reaches (then nothing bounds the positions; a ring's sinks + window may exceed
    max_len). Every other group holds max_len cells. Only the cache moves `length` (the positions
    written); cells past it hold stale values the mask hides."""

    def __init__(self, windows, batch_size, n_kv_head, max_len, key_dim, *, sinks=0, value_dim_in_keys=0,
                 dtype=torch.float32, compute_dtype=None, device=None, int4_recent=128, int4_group=32):
        self.windows, self.sinks = list(windows), sinks
        endless = all(w is not None and max_len >= w for w in self.windows)
        rings = [w is not None and (endless or max_len >= sinks + w) for w in self.windows]
        cells = [sinks + w if ring else max_len for w, ring in zip(self.windows, rings)]
        self.ring = all(rings)  # only rings: the cache is never full
        int4 = is_int4(dtype)
        if int4:
            check_int4(int4_recent, int4_group, key_dim, any(rings))
        dtype = "int4" if int4 else storage_dtype(dtype)
        self.quantized = dtype == torch.int8
        compute_dtype = compute_dtype or (torch.float32 if self.quantized or int4 else dtype)
        if compute_dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
            raise ValueError(f"compute_dtype must be a floating-point dtype, got {compute_dtype!r}")
        self.dtype, self.compute_dtype = dtype, compute_dtype
        self.value_dim_in_keys = value_dim_in_keys
        self.batch_size, self.max_len = batch_size, max(cells)
        self.layout = layout(self.windows, n_kv_head, key_dim, value_dim_in_keys, sinks)
        names = ["k"] if value_dim_in_keys else ["k", "v"]
        self.read_buffer = {} if dtype == compute_dtype else {
            name: torch.empty(batch_size, n_kv_head, self.max_len, key_dim, dtype=compute_dtype,
                              device=device) for name in names}

        def stored(name, n):  # K or V of a group of n cells
            if not self.read_buffer:
                return Stored(batch_size, n_kv_head, n, key_dim, dtype, device)
            if int4:  # its ring: a position is never further than max_len - 1 before a query
                return Int4(batch_size, n_kv_head, n, key_dim, device, compute_dtype, self.read_buffer[name],
                            min(int4_recent, max_len), int4_group)
            kind, buffer = Int8 if self.quantized else Converted, self.read_buffer[name]
            return kind(batch_size, n_kv_head, n, key_dim, dtype, device, compute_dtype, buffer)

        self.groups = []
        for window, ring, n in zip(self.windows, rings, cells):
            k, v = stored("k", n), None if value_dim_in_keys else stored("v", n)
            plain = Int4Group if int4 else GroupCache
            self.groups.append(Ring(k, v, window, sinks) if ring else plain(k, v))
        self.device = self.groups[0].k.tensors[0].device
        self.fitted = lambda: None  # a weak reference to the model whose layout it has (GPT.fits)
        self.length = 0

    def advance(self, n: int) -> None:
        """Count n more positions as written; callers check for room, so overflowing is a bug."""
        if not self.ring and self.length + n > self.max_len:
            raise RuntimeError(f"{self.length + n} positions exceed the cache size {self.max_len}")
        self.length += n

    def reset(self) -> None:
        self.length = 0

    def truncate(self, n: int) -> None:
        """Keep positions 0 .. n - 1 only: the next is written at n (a chat cut back to what a turn
        shares with the last; a ring's cells before n may hold later positions, so its callers keep
        all of it or reset it). An int4 cache's ring of recent positions is such a ring: it keeps all
        or none (n == 0)."""
        if not 0 <= n <= self.length:
            raise ValueError(f"a cache of {self.length} positions cannot keep {n}")
        if self.dtype == "int4" and n not in (0, self.length):
            raise ValueError(f"an int4 cache keeps all its {self.length} positions or none, not {n}: its "
                             f"ring of recent positions holds those after {n}")
        self.length = n

    @property
    def full(self) -> bool:
        """No cell left for the next position (a ring never is): time to refill."""
        return not self.ring and self.length == self.max_len

    def stores(self):
        """(group index, "k" or "v", its Stored) for every tensor pair the cache keeps."""
        return [(g, name, stored) for g, group in enumerate(self.groups)
                for name, stored in (("k", group.k), ("v", group.v)) if stored is not None]

    def fill_from(self, prefix: "KVCache", rows: int, starts=None) -> None:
        """Every row as if it had been fed positions 0 .. prefix.length - 1, row b's position p at
        column starts[b] + p: a prompt prefix shared by every row, computed once (in `prefix`, one row
        of plain groups stored in this cache's dtype, so that every layer after the first read the
        keys a row alone reads) and copied, as stored, into each of the first `rows`. Columns before
        a row's starts get its position 0 again, which the mask hides as padding."""
        if self.dtype == "int4":  # its prefix would have been computed with a ring of its own
            raise ValueError("an int4 cache is not filled from a prefix: feed it (share_prefix=False)")
        if prefix.dtype != self.dtype or any(group.ring for group in prefix.groups):
            raise ValueError(f"the prefix must be plain groups stored in {self.dtype}, got {prefix.dtype}")
        n = prefix.length
        columns = torch.arange(n, device=prefix.groups[0].k.tensors[0].device)
        source = columns if starts is None else (columns - starts[:, None]).clamp(min=0)  # (n,) or (B, n)
        source = source.expand(rows, n) if starts is None else source               # (B, n)
        for (g, _, stored), (_, _, given) in zip(self.stores(), prefix.stores()):
            parts = [t[0, :, :n][:, source].transpose(0, 1) for t in given.tensors]  # (B, heads, n, .)
            self.groups[g].place(stored, columns, parts, starts)
        self.length = n

    def over(self, tensors) -> "KVCache":
        """This cache with its memory in `tensors` instead, listed as `tensors` lists its own: what
        a step traced by torch.export reads and writes, its inputs."""
        view, given = copy.copy(self), iter(tensors)
        view.groups = [copy.copy(group) for group in self.groups]
        for group in view.groups:
            group.k, group.v = copy.copy(group.k), copy.copy(group.v)   # (a copy of None is None)
        for _, _, stored in view.stores():
            stored.tensors = [next(given) for _ in stored.tensors]
        view.read_buffer = {name: next(given) for name in self.read_buffer}
        for _, name, stored in view.stores() if self.read_buffer else []:
            stored.buffer = view.read_buffer[name]
        return view

    @property
    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache writes: its `buffers`, then the read buffer's."""
        return [*self.buffers, *self.read_buffer.values()]

    @property
    def buffers(self) -> list[torch.Tensor]:
        """The tensors that hold the cache's memory: every K, every V that is not inside its K, an
        int8 cache's scales, an int4 cache's scales and rings of recent positions."""
        return [t for _, _, stored in self.stores() for t in stored.tensors]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.buffers)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one position of one sequence takes across all groups, scales included
        (GPTConfig.kv_cache_formula); with rings shorter than max_len, the average over max_len."""
        return self.nbytes // (self.batch_size * self.max_len)
