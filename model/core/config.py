"""GPTConfig: the core model's shape (sizes, heads and K/V heads, positions, norm, MLP), checked once
when made. model/config.py adds the extensions' fields to it."""

import math
import numbers
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
    block_size: int = 1024  # the most positions a sequence has
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int | None = None  # None means n_head (MHA); 1 is MQA; in between is GQA
    n_embd: int = 768
    head_dim: int | None = None  # each head's width; None: n_embd // n_head
    dropout: float = 0.0
    bias: bool = True  # biases in Linear layers and LayerNorm, as in GPT-2
    pos_emb: str = "learned"  # learned: a table of positions (GPT-2); rope: rotated queries and keys
    norm: str = "layernorm"
    mlp: str = "gelu"  # GPT-2's tanh-approximated GELU; gelu_exact: the erf one (nanoGPT's nn.GELU)
    mlp_hidden: int | None = None  # the MLP's hidden width; None: 4 n_embd, or 8 ceil(n_embd / 3) with SwiGLU
    tie_embeddings: bool = True  # the output layer is the token embedding
    attn_backend: str = "sdpa"  # sdpa: PyTorch's fused kernels; naive: the formula written out
    norm_eps: float = 1e-5
    rope_base: float = 10000.0  # RoPE's base, theta (Llama 3: 500,000; Qwen3: 1,000,000)

    def __post_init__(self):
        self.check_sizes()
        self.check_options()

    def check_sizes(self) -> None:
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "n_kv_head"):
            check_int(self, name, 1)
        if self.head_dim is None:
            if self.n_embd % self.n_head:
                raise ValueError(f"GPTConfig.n_embd={self.n_embd} must be divisible by n_head={self.n_head} "
                                 f"(or set head_dim)")
            self.head_dim = self.n_embd // self.n_head
        check_int(self, "head_dim", 1)
        if self.mlp_hidden is not None:
            check_int(self, "mlp_hidden", 1)
        if self.n_head % self.n_kv_head:
            raise ValueError(f"GPTConfig.n_kv_head={self.n_kv_head} must divide n_head={self.n_head}")

    def check_options(self) -> None:
        for name, allowed in OPTIONS.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)!r} is not one of "
                                 f"{', '.join(allowed)}")
        if self.pos_emb == "rope" and self.rope_dim % 2:
            raise ValueError(f"GPTConfig.pos_emb='rope' needs an even GPTConfig.head_dim (RoPE rotates "
                             f"pairs of numbers), got {self.head_dim}")
        if not is_real(self.rope_base) or not 1 < self.rope_base < math.inf:
            raise ValueError(f"GPTConfig.rope_base must be a finite number > 1, got {self.rope_base!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")
        if not 0 < self.norm_eps < math.inf:
            raise ValueError(f"GPTConfig.norm_eps must be a positive finite number, got {self.norm_eps}")

    @property
    def rope_dim(self) -> int:
        """The width RoPE rotates: each head's."""
        return self.head_dim

    @property
    def mlp_width(self) -> int:
        """The MLP's hidden width: mlp_hidden, or by default GELU's 4 n_embd, and with SwiGLU (three
        matrices instead of two) 8 ceil(n_embd / 3), which keeps the parameter count (rounded up to
        a multiple of 8)."""
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        return 8 * math.ceil(self.n_embd / 3) if self.mlp == "swiglu" else 4 * self.n_embd


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
