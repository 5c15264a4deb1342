"""A GPT and what decoding it needs, importing torch (safetensors: Hugging Face folders) and itself.
model/core/ is the core a learner reads (config, attention, kv_cache, gpt, generate); every other file
builds one extension on it (docs/variants.md, "Where each extension lives")."""

from model.config import GPTConfig
from model.core.attention import attend
from model.generation import Decoding, generate
from model.gpt import GPT
from model.kv_cache import KVCache
from model.loading import load_model
from model.sampling import Sampling

__all__ = ["GPT", "Decoding", "GPTConfig", "KVCache", "Sampling", "attend", "generate", "load_model"]
