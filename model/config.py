"""GPTConfig: every architectural choice of the model, checked once at construction."""

from dataclasses import dataclass

OPTIONS = {
    "pos_emb": ("learned", "rope"),
    "norm": ("layernorm", "rmsnorm"),
    "mlp": ("gelu", "swiglu"),
    "attn_backend": ("sdpa", "naive"),
}


@dataclass
class GPTConfig:
    vocab_size: int | None = 50257  # None only in configs/model/: train.py takes the data's
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_kv_head: int | None = None  # None means n_head (MHA); 1 is MQA; in between is GQA
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True  # biases in Linear layers and LayerNorm, as in GPT-2
    pos_emb: str = "learned"
    norm: str = "layernorm"
    mlp: str = "gelu"
    qk_norm: bool = False
    tie_embeddings: bool = True
    attn_backend: str = "sdpa"
    norm_eps: float = 1e-5

    def __post_init__(self):
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"GPTConfig.{name} must be a positive integer, got {value!r}")
        if not isinstance(self.n_kv_head, int) or self.n_kv_head < 1:
            raise ValueError(f"GPTConfig.n_kv_head must be an integer >= 1, got {self.n_kv_head!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"GPTConfig.n_embd={self.n_embd} must be divisible by n_head={self.n_head}"
            )
        if self.n_head % self.n_kv_head:
            raise ValueError(
                f"GPTConfig.n_kv_head={self.n_kv_head} must divide n_head={self.n_head}"
            )
        for name, allowed in OPTIONS.items():
            if getattr(self, name) not in allowed:
                raise ValueError(
                    f"GPTConfig.{name}={getattr(self, name)!r} is not one of {', '.join(allowed)}"
                )
        if self.pos_emb == "rope" and self.head_dim % 2:
            raise ValueError(
                f"GPTConfig.pos_emb='rope' needs an even head dim, "
                f"but n_embd/n_head = {self.head_dim}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")
        if self.norm_eps <= 0:
            raise ValueError(f"GPTConfig.norm_eps must be positive, got {self.norm_eps}")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head
