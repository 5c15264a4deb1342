"""A GPT and what decoding it needs: config, attention (the one core), kv_cache, gpt, generation,
checkpoint, device, quantize, convert. It imports torch (safetensors for GPT-2) and itself only."""

from model.attention import attend
from model.config import GPTConfig
from model.generation import generate, load_model
from model.gpt import GPT
from model.kv_cache import KVCache
from model.sampling import Sampling

__all__ = ["GPT", "GPTConfig", "KVCache", "Sampling", "attend", "generate", "load_model"]
