"""GPTConfig: every architectural choice of the model, checked once at construction."""

import dataclasses
import math
import numbers
import typing
from dataclasses import dataclass

INT64_MAX = 2**63 - 1  # the largest integer torch holds

OPTIONS = {
    "pos_emb": ("learned", "rope"),
    "norm": ("layernorm", "rmsnorm"),
    "mlp": ("gelu", "gelu_exact", "swiglu"),
    "attn_backend": ("sdpa", "naive"),
}


@dataclass
class GPTConfig:
    vocab_size: int | None = 50257  # None only in configs/model/: train.py takes the data's
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int | None = None  # None means n_head (MHA); 1 is MQA; in between is GQA
    mla_latent_dim: int | None = None  # set: multi-head latent attention, K/V from a latent this wide
    mla_rope_dim: int = 0  # MLA: width of the decoupled RoPE key shared by all heads
    kv_share: int = 1  # adjacent layers sharing one K/V (cross-layer attention); 1: each its own
    attn_window: int | None = None  # set: a query sees the last attn_window positions, its own included
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linear layers and LayerNorm, as in GPT-2
    pos_emb: str = "learned"
    norm: str = "layernorm"
    mlp: str = "gelu"  # GPT-2's tanh-approximated GELU; gelu_exact: the erf one (nanoGPT's nn.GELU)
    qk_norm: bool = False
    tie_embeddings: bool = True
    attn_backend: str = "sdpa"
    norm_eps: float = 1e-5

    def __post_init__(self):
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "n_kv_head", "kv_share"):
            check_int(self, name, 1)
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_embd={self.n_embd} must be divisible by n_head={self.n_head}"
            )
        if self.n_head % self.n_kv_head:
            raise ValueError(
                f"GPTConfig.n_kv_head={self.n_kv_head} must divide n_head={self.n_head}"
            )
        if self.kv_share > self.n_layer:
            raise ValueError(f"GPTConfig.kv_share must be in 1..n_layer={self.n_layer}, got {self.kv_share}")
        self.check_mla()
        if self.attn_window is not None:
            check_int(self, "attn_window", 1)
            if self.attn_window > self.block_size:
                raise ValueError(f"GPTConfig.attn_window={self.attn_window} must be <= block_size="
                                 f"{self.block_size} (null: attend over the whole block)")
        for name, allowed in OPTIONS.items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"GPTConfig.{name}={getattr(self, name)!r} is not one of {', '.join(allowed)}"
                )
        if self.pos_emb == "rope" and self.mla_latent_dim is None and self.head_dim % 2:
            raise ValueError(
                f"GPTConfig.pos_emb='rope' needs an even head dim, "
                f"but n_embd/n_head = {self.head_dim}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")
        if not 0 < self.norm_eps < math.inf:
            raise ValueError(f"GPTConfig.norm_eps must be a positive finite number, got {self.norm_eps}")

    def check_mla(self) -> None:
        check_int(self, "mla_rope_dim", 0)
        if self.mla_latent_dim is None:
            if self.mla_rope_dim:
                raise ValueError(f"GPTConfig.mla_rope_dim={self.mla_rope_dim} is for multi-head latent "
                                 f"attention: set mla_latent_dim too (or attention=mla)")
            return
        check_int(self, "mla_latent_dim", 1)
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

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def rope_dim(self) -> int:
        """The width RoPE rotates: each head's, or MLA's decoupled RoPE key's."""
        return self.head_dim if self.mla_latent_dim is None else self.mla_rope_dim

    @property
    def max_positions(self) -> int | None:
        """How many positions a sequence may have: block_size, or None (no limit) for a sliding
        window with RoPE, which never sees farther back than its window and has no position table."""
        return None if self.attn_window is not None and self.pos_emb == "rope" else self.block_size

    @property
    def receptive_field(self) -> int | None:
        """How many of the last tokens the next one depends on: with a window, each of n_layer
        layers reaches attn_window - 1 positions further back; None without one (all of them)."""
        return None if self.attn_window is None else self.n_layer * (self.attn_window - 1) + 1

    @property
    def kv_layers(self) -> int:
        """Layers that keep keys and values in the cache: one per group of kv_share layers."""
        return -(-self.n_layer // self.kv_share)

    def kv_cache_formula(self) -> str:
        """The numbers one cached position holds, e.g. '4 layers x 2 (K, V) x 2 kv heads x 32'."""
        layers = f"{self.kv_layers} layer{'s' * (self.kv_layers > 1)}"
        if self.kv_share > 1:
            layers += f" (n_layer {self.n_layer} / kv_share {self.kv_share}" + \
                (", rounded up)" if self.n_layer % self.kv_share else ")")
        if self.mla_latent_dim is not None:
            return f"{layers} x ({self.mla_latent_dim} latent + {self.mla_rope_dim} rope)"
        return f"{layers} x 2 (K, V) x {self.n_kv_head} kv head{'s' * (self.n_kv_head > 1)} x {self.head_dim}"


def check_int(config: GPTConfig, name: str, minimum: int) -> None:
    """config.<name> is an integer (not a bool) >= minimum, or a ValueError naming the field."""
    check_integer(getattr(config, name), f"GPTConfig.{name}", minimum)


def check_integer(value, name: str, minimum: int = 0, maximum: int = INT64_MAX) -> None:
    """value is an integer (not a bool) in minimum..maximum, or a ValueError naming it `name`."""
    if not is_integer(value) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    if value > maximum:
        raise ValueError(f"{name} must be at most {maximum}, got {value}")


def is_integer(value) -> bool:
    """An int of any kind (Python's, numpy's), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
    """A real number of any kind (int, float, numpy's), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


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
