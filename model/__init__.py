"""A GPT and what decoding it needs, importing torch (safetensors: Hugging Face folders) and itself. Its
files, bottom up: config, device, kv_cache, quantize, attention (the one core), pretrained, gpt,
checkpoint, convert, sampling, prefill, step_package, decode_step, recorder, generation."""

from model.attention import attend
from model.config import GPTConfig
from model.generation import generate, load_model
from model.gpt import GPT
from model.kv_cache import KVCache
from model.sampling import Sampling

__all__ = ["GPT", "GPTConfig", "KVCache", "Sampling", "attend", "generate", "load_model"]
