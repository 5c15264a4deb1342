"""GPTConfig: the core's config (model/core/config.py) with the extensions' fields, checked once at
construction. They are multi-head latent attention, cross-layer K/V sharing, sliding windows and
sinks, qk-norm, Qwen2's q/k/v biases and Llama 3's RoPE scaling."""

import dataclasses
import math
import typing
from dataclasses import dataclass

from model.core.config import INT64_MAX, check_int, check_integer, is_integer, is_real  # noqa: F401
from model.core.config import GPTConfig as CoreConfig

# Llama 3's RoPE scaling (rope_type llama3): wavelengths past original_max_position_embeddings /
# low_freq_factor are stretched by `factor`, those under ... / high_freq_factor kept, those between blended.
ROPE_SCALING_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


@dataclass
class GPTConfig(CoreConfig):
    mla_latent_dim: int | None = None  # set: multi-head latent attention, K/V from a latent this wide
    mla_rope_dim: int = 0  # MLA: width of the decoupled RoPE key shared by all heads
    mla_kv_norm: bool = True  # MLA: the latent normalised (DeepSeek's); false: used as projected (a retrofit)
    mla_rope_pairs: list[int] | None = None  # MLA: the RoPE key's pairs' indices in the head_dim-wide table
    kv_share: int = 1  # adjacent layers sharing one K/V (cross-layer attention); 1: each its own
    attn_window: int | None = None  # set: a query sees the last attn_window positions, its own included
    window_pattern: str | None = None  # per layer S (within attn_window) or L (all), tiled; None: all S
    attn_sinks: int = 0  # windowed layers also see the first attn_sinks positions, forever (StreamingLLM)
    attn_sink_logit: bool = False  # a learned logit per head joins every softmax (gpt-oss's sinks)
    qk_norm: bool = False  # queries and keys normalised per head (Qwen3)
    qkv_bias: bool | None = None  # biases on q, k and v alone (Qwen2's); None: as `bias`
    rope_scaling: list[float] | None = None  # Llama 3's frequency scaling, ROPE_SCALING_KEYS' values

    def __post_init__(self):
        self.check_sizes()
        check_int(self, "kv_share", 1)
        if self.qkv_bias is not None and not isinstance(self.qkv_bias, bool):
            raise ValueError(f"GPTConfig.qkv_bias must be true, false or null, got {self.qkv_bias!r}")
        if self.kv_share > self.n_layer:
            raise ValueError(f"GPTConfig.kv_share must be in 1..n_layer={self.n_layer}, got {self.kv_share}")
        self.check_mla()
        self.check_windows()
        self.check_options()
        self.check_rope_scaling()

    def check_rope_scaling(self) -> None:
        scaling = self.rope_scaling
        if scaling is None:
            return
        if not isinstance(scaling, typing.Sequence) or len(scaling) != len(ROPE_SCALING_KEYS) \
                or not all(is_real(v) and 0 < v < math.inf for v in scaling):
            raise ValueError(f"GPTConfig.rope_scaling must be null or Llama 3's "
                             f"[{', '.join(ROPE_SCALING_KEYS)}], each a positive number, got {scaling!r}")
        self.rope_scaling = scaling = [float(v) for v in scaling]  # (a plain list, as a checkpoint keeps it)
        if scaling[2] <= scaling[1]:
            raise ValueError(f"GPTConfig.rope_scaling: high_freq_factor must exceed low_freq_factor, got "
                             f"{scaling[2]} and {scaling[1]}")

    def check_mla(self) -> None:
        check_int(self, "mla_rope_dim", 0)
        if not isinstance(self.mla_kv_norm, bool):
            raise ValueError(f"GPTConfig.mla_kv_norm must be true or false, got {self.mla_kv_norm!r}")
        if self.mla_latent_dim is None:
            for name, value in (("mla_rope_dim", self.mla_rope_dim), ("mla_kv_norm", not self.mla_kv_norm),
                                ("mla_rope_pairs", self.mla_rope_pairs is not None)):
                if value:
                    raise ValueError(f"GPTConfig.{name}={getattr(self, name)!r} is for multi-head latent "
                                     f"attention: set mla_latent_dim too (or attention=mla)")
            return
        check_int(self, "mla_latent_dim", 1)
        for name in ("mla_latent_dim", "mla_rope_dim"):  # (allocated per layer: n_embd x width, and more)
            if getattr(self, name) > 8 * self.n_embd:
                raise ValueError(f"GPTConfig.{name} must be at most 8 x n_embd = {8 * self.n_embd} (the "
                                 f"latent and RoPE key stand for the keys and values of every head, 2 x "
                                 f"n_embd wide in MHA), got {getattr(self, name)}")
        if self.n_kv_head != self.n_head:
            raise ValueError(f"GPTConfig.n_kv_head={self.n_kv_head} does not apply to multi-head latent "
                             f"attention (mla_latent_dim={self.mla_latent_dim}): every head has its own "
                             f"keys from the latent; leave n_kv_head = n_head={self.n_head}")
        if self.qk_norm:
            raise ValueError("GPTConfig.qk_norm=true cannot be combined with multi-head latent attention "
                             "(mla_latent_dim): a norm of each head's key cannot be absorbed into the query")
        if self.pos_emb == "rope" and (self.mla_rope_dim == 0 or self.mla_rope_dim % 2):
            raise ValueError(f"GPTConfig.mla_rope_dim must be even and > 0 with pos_emb='rope' and "
                             f"multi-head latent attention: the RoPE key carries the positions; "
                             f"got {self.mla_rope_dim}")
        self.check_rope_pairs()

    def check_rope_pairs(self) -> None:
        """mla_rope_pairs: null, or with RoPE one index of the head_dim-wide frequency table per pair
        of the RoPE key (mla_rope_dim / 2), as a retrofit (model/retrofit.py) keeps the heads' pairs."""
        pairs, half = self.mla_rope_pairs, self.head_dim // 2
        if pairs is None:
            return
        if self.pos_emb != "rope":
            raise ValueError(f"GPTConfig.mla_rope_pairs is for pos_emb='rope' (the RoPE key's "
                             f"frequencies), got pos_emb={self.pos_emb!r}: leave it null")
        if not isinstance(pairs, typing.Sequence) or isinstance(pairs, str) or len(pairs) != \
                self.mla_rope_dim // 2 or not all(is_integer(i) and 0 <= i < half for i in pairs):
            raise ValueError(f"GPTConfig.mla_rope_pairs must be null or mla_rope_dim / 2 = "
                             f"{self.mla_rope_dim // 2} indices, each an integer in 0..{half - 1} "
                             f"(head_dim / 2 - 1), got {pairs!r:.200}")
        self.mla_rope_pairs = [int(i) for i in pairs]  # (a plain list, as a checkpoint keeps it)

    def check_windows(self) -> None:
        check_int(self, "attn_sinks", 0)
        if not isinstance(self.attn_sink_logit, bool):
            raise ValueError(f"GPTConfig.attn_sink_logit must be true or false, got {self.attn_sink_logit!r}")
        if self.attn_window is None:
            for name, value in (("window_pattern", self.window_pattern), ("attn_sinks", self.attn_sinks)):
                if value:
                    raise ValueError(f"GPTConfig.{name}={value!r} is for sliding-window layers: "
                                     f"set attn_window too")
            return
        check_int(self, "attn_window", 1)
        if self.attn_sinks > self.block_size:  # (a cache holds them beside the window)
            raise ValueError(f"GPTConfig.attn_sinks={self.attn_sinks} must be <= block_size="
                             f"{self.block_size}: the first positions every windowed layer keeps seeing, "
                             f"among those it trains on")
        if self.attn_window > self.block_size:
            raise ValueError(f"GPTConfig.attn_window={self.attn_window} must be <= block_size="
                             f"{self.block_size} (null: attend over the whole block)")
        pattern = self.window_pattern
        if pattern is None:
            return
        if not isinstance(pattern, str) or not pattern or set(pattern) - set("SL") or "S" not in pattern \
                or len(pattern) > self.n_layer:
            raise ValueError(f"GPTConfig.window_pattern={pattern!r} must be 1..n_layer={self.n_layer} "
                             f"letters S (a layer within attn_window) or L (a layer over the whole "
                             f"context), one S at least, repeated over the layers: e.g. SSSSSL (Gemma) "
                             f"or SL (gpt-oss)")
        for first in range(0, self.n_layer, self.kv_share):
            group = {self.layer_window(i) for i in range(first, min(first + self.kv_share, self.n_layer))}
            if len(group) > 1:
                raise ValueError(f"GPTConfig.window_pattern={pattern!r}: layers {first}.."
                                 f"{first + self.kv_share - 1} share their K/V (kv_share={self.kv_share}), "
                                 f"so they must share a window: give them one letter")

    def layer_window(self, layer: int) -> int | None:
        """The window of layer `layer`: attn_window, or None where the pattern says L (everything)."""
        pattern = self.window_pattern
        return None if pattern is not None and pattern[layer % len(pattern)] == "L" else self.attn_window

    @property
    def windows(self) -> list[int | None]:
        """Every layer's window (None: the whole context)."""
        return [self.layer_window(i) for i in range(self.n_layer)]

    @property
    def rope_dim(self) -> int:
        """The width RoPE rotates: each head's, or MLA's decoupled RoPE key's."""
        return self.head_dim if self.mla_latent_dim is None else self.mla_rope_dim

    @property
    def max_positions(self) -> int | None:
        """How many positions a sequence may have: block_size, or None (no limit) where every layer
        has a window and RoPE, so none sees farther back than its window (or its sinks) and there is
        no position table."""
        endless = self.pos_emb == "rope" and None not in self.windows
        return None if endless else self.block_size

    @property
    def receptive_field(self) -> int | None:
        """How many of the last tokens the next one depends on: where every layer has a window and no
        sinks, each of n_layer layers reaches attn_window - 1 positions further back; None otherwise
        (all of them: a layer over the whole context, or sinks, reach the first token)."""
        if None in self.windows or self.attn_sinks:
            return None
        return self.n_layer * (self.attn_window - 1) + 1

    @property
    def context_size(self) -> int | None:
        """How many of the last tokens the next one depends on: the positions a sequence may have,
        or the receptive field; None: all of them."""
        return self.max_positions or self.receptive_field

    @property
    def kv_layers(self) -> int:
        """Layers that keep keys and values in the cache: one per group of kv_share layers."""
        return -(-self.n_layer // self.kv_share)

    @property
    def kv_windows(self) -> list[int | None]:
        """The window of each cached layer (the first of each kv_share group)."""
        return self.windows[::self.kv_share]

    def kv_cache_formula(self) -> str:
        """The numbers one cached position holds, e.g. '4 layers x 2 (K, V) x 2 kv heads x 32'; with
        local and global layers, what each kind holds, e.g. '2 layers x ... (+ 4 windowed layers x ...,
        the last 64 + 4 sink positions)'."""
        if self.mla_latent_dim is not None:
            per_layer = f"({self.mla_latent_dim} latent + {self.mla_rope_dim} rope)"
        else:
            per_layer = f"2 (K, V) x {self.n_kv_head} kv head{'s' * (self.n_kv_head > 1)} x {self.head_dim}"
        shared = ""
        if self.kv_share > 1:
            shared = f" (n_layer {self.n_layer} / kv_share {self.kv_share}" + \
                (", rounded up)" if self.n_layer % self.kv_share else ")")
        windowed = sum(w is not None for w in self.kv_windows)
        if windowed in (0, self.kv_layers) and not self.attn_sinks:
            return f"{self.kv_layers} layer{'s' * (self.kv_layers > 1)}{shared} x {per_layer}"
        keeps = f"the last {self.attn_window}" + (f" + {self.attn_sinks} sink" if self.attn_sinks else "")
        window = f"{windowed} windowed layer{'s' * (windowed > 1)} x {per_layer}, {keeps} positions"
        if windowed == self.kv_layers:
            return window + shared
        full = self.kv_layers - windowed
        return f"{full} layer{'s' * (full > 1)}{shared} x {per_layer} (+ {window})"

    def kv_cache_bytes(self, positions: int, itemsize: int, scale_itemsize: int = 0) -> int:
        """The bytes one sequence of `positions` takes in the cache, by kv_cache_formula: each cached
        layer's cells times the numbers a cell holds, `itemsize` bytes each, and where the cache is
        int8, one scale of `scale_itemsize` bytes per cell and K/V head for K and for V (MLA: one
        for its latent). A windowed layer's cells are its ring's (window + sinks) where positions
        outrun it or every layer has a window it reaches; else every position has a cell."""
        mla = self.mla_latent_dim is not None
        numbers = self.mla_latent_dim + self.mla_rope_dim if mla else 2 * self.n_kv_head * self.head_dim
        scales = 1 if mla else 2 * self.n_kv_head
        endless = all(w is not None and positions >= w for w in self.kv_windows)
        cells = [self.attn_sinks + w if w is not None and (endless or positions >= self.attn_sinks + w)
                 else positions for w in self.kv_windows]
        return sum(cells) * (numbers * itemsize + scales * scale_itemsize)



def check_integer_fields(config, prefix: str) -> None:
    """Every integer of a dataclass's int fields (int, int | None, list[int]) fits in torch's int64:
    a config holds no number that would overflow where it is used."""
    for f in dataclasses.fields(config):
        if int not in (f.type, *typing.get_args(f.type)) and f.type != list[int]:
            continue
        value = getattr(config, f.name)
        for item in value if isinstance(value, list) else [value]:
            if is_integer(item) and not -INT64_MAX - 1 <= item <= INT64_MAX:
                raise ValueError(f"{prefix}{f.name}={item} is out of range: an integer here fits in "
                                 f"64 bits ({-INT64_MAX - 1}..{INT64_MAX})")
