"""The GPT, and what decoding it needs. Nothing here trains or reads a command line: it imports
torch (and safetensors, to read a Hugging Face GPT-2) and itself.

    config.py      GPTConfig: the architecture, every field checked when it is made
    attention.py   attend, the one attention core; MHA/GQA/MQA (n_kv_head) and MLA; RoPE
    kv_cache.py    KVCache: static, preallocated keys and values (float32, bf16, int8; a ring)
    gpt.py         GPT: embeddings, blocks, head, the cached forward, GPT-2 weights
    generation.py  sampling, cached and uncached streams, the compiled decode step, load_model
    checkpoint.py  the checkpoint file: save, load, find one in a run dir, check its weights
    device.py      devices, and the precision a model decodes in
    quantize.py    int8 weight-only Linear layers for CPU decoding
    convert.py     MHA -> GQA/MQA checkpoints; our weights as transformers' Llama/Mistral/DeepseekV3
"""

from model.attention import attend
from model.config import GPTConfig
from model.generation import Sampling, generate, load_model
from model.gpt import GPT
from model.kv_cache import KVCache

__all__ = ["GPT", "GPTConfig", "KVCache", "Sampling", "attend", "generate", "load_model"]
