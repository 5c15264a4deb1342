"""The library: a GPT (model.gpt), its config, the one attention core and the static KV cache.
Checkpoints, generation, devices, conversion, quantization and figures are its submodules."""

from model.attention import attend
from model.config import GPTConfig
from model.gpt import GPT
from model.kv_cache import KVCache

__all__ = ["GPT", "GPTConfig", "KVCache", "attend"]
