"""A GPT and what decoding it needs. Its files, from the bottom up: config, device, kv_cache,
quantize, attention (the one core), pretrained, gpt, checkpoint, convert, sampling, prefill,
step_package, decode_step, recorder, generation. It imports torch (safetensors for Hugging Face folders) and itself only."""

from model.attention import attend
from model.config import GPTConfig
from model.generation import generate, load_model
from model.gpt import GPT
from model.kv_cache import KVCache
from model.sampling import Sampling

__all__ = ["GPT", "GPTConfig", "KVCache", "Sampling", "attend", "generate", "load_model"]
