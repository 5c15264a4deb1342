from model.attention import attend
from model.config import GPTConfig
from model.gpt import GPT
from model.kv_cache import KVCache

__all__ = ["GPT", "GPTConfig", "KVCache", "attend"]
