"""GGUF files (llama.cpp's, Ollama's) of the llama architecture read as our GPT, through the `gguf`
library: SmolLM2, Llama 3 (before 3.1's RoPE scaling), Mistral Nemo and the like.

gguf_config reads the metadata alone (no tensor data): the GPTConfig, checked against every
tensor's name, shape and type before anything is built, each refusal one ValueError naming the file.
read_gguf then dequantizes each tensor to float32 (gguf.quants.dequantize), undoes llama.cpp's
reordering of q and k, fuses q/k/v and gate/up as model.pretrained does a folder's, and loads it.
"""

import functools
from pathlib import Path

import numpy as np
import torch

from model.config import GPTConfig, is_integer, is_real
from model.gpt import GPT
from model.pretrained import is_finite, sizes_made, tensors_differ

# llama.cpp's tensor names: ours, theirs (model.pretrained's LLAMA_OUTER, LLAMA_NAMES, LLAMA_FUSED
# for a folder). In layer i, ours under blocks.<i>., theirs under blk.<i>.; a fused matrix of ours
# is theirs stacked along the output rows, in this order.
GGUF_OUTER = {"wte.weight": "token_embd.weight", "norm_f.weight": "output_norm.weight",
              "lm_head.weight": "output.weight"}
GGUF_NAMES = {"norm_1.weight": "attn_norm.weight", "norm_2.weight": "ffn_norm.weight",
              "attn.proj.weight": "attn_output.weight", "mlp.proj.weight": "ffn_down.weight"}
GGUF_FUSED = {"attn.qkv.weight": ("attn_q.weight", "attn_k.weight", "attn_v.weight"),
              "mlp.fc.weight": ("ffn_gate.weight", "ffn_up.weight")}
# Keys of a llama GGUF that change the model in ways we do not build (present: refused).
UNBUILT_KEYS = ("logit_scale", "embedding_scale", "residual_scale", "attention.scale",
                "attn_logit_softcapping", "final_logit_softcapping", "attention.clamp_kqv",
                "attention.sliding_window", "rope.scaling.attn_factor", "rope.scaling.yarn_log_multiplier")


def is_gguf(path) -> bool:
    """Whether `path` is a file that opens with GGUF's magic bytes."""
    try:
        with open(Path(path).expanduser(), "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:  # (a folder, a missing file)
        return False


def gguf_reader(path: Path):
    """The file's GGUFReader: its metadata parsed (~2 s for 49k tokens), its tensors mapped, not read.
    One is kept, for as long as the file is unchanged: loading asks for the config, then the model."""
    stat = path.stat()
    return cached_reader(str(path.resolve()), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=1)
def cached_reader(path: str, mtime_ns: int, size: int):
    from gguf import GGUFReader

    try:
        return GGUFReader(path)
    except Exception as e:  # noqa: BLE001  the library's own error for a damaged or truncated file
        raise ValueError(f"{path} is not a GGUF file kvgpt can read ({type(e).__name__}: {e})") from e


def metadata(reader, key: str, kind: str, path: Path, default=...):
    """The value of metadata `key`, of `kind` ("an integer", "a number", "a string"), else a ValueError
    naming the file and the key; `default` where the file has none (none given: it must be there)."""
    if key not in reader.fields:
        if default is ...:
            raise ValueError(f"{path} has no {key} in its metadata (a llama GGUF file holds it)")
        return default
    value = reader.fields[key].contents()
    ok = {"an integer": is_integer, "a number": is_real, "a string": lambda v: isinstance(v, str)}[kind]
    if not ok(value):
        raise ValueError(f"{path}: {key} must be {kind}, got {str(value)[:60]}")
    return value


def gguf_config(path) -> GPTConfig:
    """The GPTConfig of the llama GGUF file `path`, from its metadata, checked against its tensors'
    names, shapes and types (no tensor data read): a ValueError naming the file where it is not one
    we build (another architecture, RoPE scaling, experts, a type gguf cannot dequantize)."""
    path = Path(path).expanduser()
    reader = gguf_reader(path)
    arch = metadata(reader, "general.architecture", "a string", path)
    if arch != "llama":
        raise ValueError(f"{path}: general.architecture={arch!r} is not supported (kvgpt reads GGUF files "
                         f"of the llama architecture: SmolLM2, Llama 3, Mistral Nemo)")
    check_unbuilt(reader, path)

    def get(key, kind="an integer", default=...):
        return metadata(reader, f"llama.{key}", kind, path, default)

    tokens = reader.fields.get("tokenizer.ggml.tokens")
    n_embd, n_head = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length", default=None)
    fields = {"vocab_size": len(tokens.data) if tokens else get("vocab_size"),
              "block_size": get("context_length"), "n_layer": get("block_count"), "n_head": n_head,
              "n_kv_head": get("attention.head_count_kv", default=n_head), "n_embd": n_embd,
              "head_dim": head_dim, "mlp_hidden": get("feed_forward_length"),
              "norm_eps": get("attention.layer_norm_rms_epsilon", "a number"),
              "rope_base": get("rope.freq_base", "a number", 10000.0),
              "tie_embeddings": "output.weight" not in {t.name for t in reader.tensors},
              "pos_emb": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False}
    try:
        config = GPTConfig(**fields)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    for key in ("attention.value_length", "rope.dimension_count"):  # (each head's, whole: ours)
        if get(key, default=config.head_dim) != config.head_dim:
            raise ValueError(f"{path}: llama.{key}={get(key)} is not supported (kvgpt builds heads whose "
                             f"keys, values and RoPE all span head_dim={config.head_dim})")
    check_tensors(reader, config, path)
    return config


def check_unbuilt(reader, path: Path) -> None:
    """Refuse what a llama GGUF may hold that we do not build: experts, RoPE scaling (linear by 1 is
    none), a tokenizer other than a byte-level BPE, and the keys of UNBUILT_KEYS."""
    if metadata(reader, "llama.expert_count", "an integer", path, 0) > 0:
        raise ValueError(f"{path}: llama.expert_count={reader.fields['llama.expert_count'].contents()} is "
                         f"not supported (kvgpt builds dense layers, no experts)")
    kind = metadata(reader, "llama.rope.scaling.type", "a string", path, "none")
    factor = metadata(reader, "llama.rope.scaling.factor", "a number", path, 1.0)
    factor = metadata(reader, "llama.rope.scale_linear", "a number", path, factor)  # (older files' key)
    if kind not in ("none", "linear") or factor != 1.0:
        raise ValueError(f"{path}: llama.rope.scaling.type={kind!r} with factor {factor} is not supported "
                         f"(kvgpt builds plain RoPE from a llama GGUF)")
    tokenizer = metadata(reader, "tokenizer.ggml.model", "a string", path, "gpt2")
    if tokenizer != "gpt2":  # (data.gguf reads the tokenizer; refused here, before any weight is read)
        raise ValueError(f"{path}: tokenizer.ggml.model={tokenizer!r} is not supported (kvgpt reads "
                         f"byte-level BPE vocabularies, 'gpt2': Llama 3, Qwen2, SmolLM2)")
    if unbuilt := [key for key in UNBUILT_KEYS if f"llama.{key}" in reader.fields]:
        raise ValueError(f"{path}: llama.{unbuilt[0]} is not supported (kvgpt builds Llama's plain "
                         f"decoder: no scales, soft caps, clamps or windows)")


def gguf_shapes(c: GPTConfig) -> dict[str, tuple]:
    """The tensors a llama GGUF of config `c` holds, each shape as torch has it (rows, columns), each
    size with the metadata it comes from. (GGUF lists a shape's dimensions the other way round.)"""
    width, vocab = (c.n_embd, "embedding_length"), (c.vocab_size, "vocab_size")
    q = (c.n_head * c.head_dim, "head_count x key_length")
    kv = (c.n_kv_head * c.head_dim, "head_count_kv x key_length")
    hidden = (c.mlp_width, "feed_forward_length")
    layer = {"attn_norm.weight": (width,), "ffn_norm.weight": (width,), "attn_q.weight": (q, width),
             "attn_k.weight": (kv, width), "attn_v.weight": (kv, width), "attn_output.weight": (width, q),
             "ffn_gate.weight": (hidden, width), "ffn_up.weight": (hidden, width),
             "ffn_down.weight": (width, hidden)}
    outer = {"token_embd.weight": (vocab, width), "output_norm.weight": (width,)}
    if not c.tie_embeddings:
        outer["output.weight"] = (vocab, width)
    return outer | {f"blk.{i}.{name}": shape for i in range(c.n_layer) for name, shape in layer.items()}


def check_tensors(reader, c: GPTConfig, path: Path) -> None:
    """The file's tensors are those gguf_shapes gives, none missing or left over, each of its shape
    and of a type gguf.quants.dequantize reads: else a ValueError naming the file and the tensor."""
    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise ValueError(f"{path}: rope_freqs.weight (Llama 3.1's RoPE scaling, as llama.cpp stores it) is "
                         f"not supported (kvgpt builds plain RoPE from a llama GGUF)")
    expected = gguf_shapes(c)
    if differ := tensors_differ(expected, tensors):
        raise ValueError(f"{path}: tensors do not match its metadata (a Llama of its metadata has other "
                         f"tensors: {differ})")
    for name, sizes in expected.items():
        shape = tuple(int(n) for n in reversed(tensors[name].shape))
        if shape != tuple(size for size, _ in sizes):
            raise ValueError(f"{path}: {name} is {list(shape)}, its metadata makes it [{sizes_made(sizes)}]")
        if not dequantizable(tensors[name].tensor_type):
            raise ValueError(f"{path}: {name} is of type {tensors[name].tensor_type.name}, which the gguf "
                             f"library cannot dequantize (kvgpt reads the float, Q and IQ types it can)")


@functools.cache
def dequantizable(qtype) -> bool:
    """Whether gguf.quants.dequantize reads `qtype`: one block of zeros tells."""
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    try:
        dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    except (NotImplementedError, KeyError):
        return False
    return True


def read_gguf(path, dtype=torch.float32) -> GPT:
    """The model of the llama GGUF file `path` (gguf_config's checks first), its weights dequantized
    into `dtype`. Built on the meta device and then given memory, as GPT.from_pretrained builds a
    folder's: no weight initialised only to be overwritten; every weight must come from the file."""
    path = Path(path).expanduser()
    config = gguf_config(path)
    state = gguf_state(gguf_reader(path), config, path, dtype)
    return GPT.from_state(config, state, dtype, path, "a Llama of its metadata")


def gguf_state(reader, config: GPTConfig, path: Path, dtype) -> dict:
    """Our state dict from the file's tensors: renamed, q/k/v and gate/up fused, in `dtype`."""
    tensors = {t.name: t for t in reader.tensors}

    def weight(name):
        return dequantized(tensors[name], config, path).to(dtype)

    state = {ours: weight(theirs) for ours, theirs in GGUF_OUTER.items() if theirs in tensors}
    for i in range(config.n_layer):
        state |= {f"blocks.{i}.{ours}": weight(f"blk.{i}.{theirs}") for ours, theirs in GGUF_NAMES.items()}
        for ours, parts in GGUF_FUSED.items():
            state[f"blocks.{i}.{ours}"] = torch.cat([weight(f"blk.{i}.{part}") for part in parts])
    return state


def dequantized(tensor, config: GPTConfig, path: Path) -> torch.Tensor:
    """One tensor of the file in float32, in torch's shape, checked finite; q and k in the order of
    each head's rows that our RoPE (transformers') rotates."""
    from gguf.quants import dequantize

    values = dequantize(tensor.data, tensor.tensor_type)  # (float32; F32's a view of the mapped file)
    shape = tuple(int(n) for n in reversed(tensor.shape))
    weight = torch.from_numpy(np.require(values, np.float32, ["C", "W"])).reshape(shape)
    if not is_finite(weight):
        raise ValueError(f"{path}: {tensor.name} holds NaN or inf: a damaged file")
    if tensor.name.endswith((".attn_q.weight", ".attn_k.weight")):
        heads = config.n_head if ".attn_q." in tensor.name else config.n_kv_head
        weight = unpermute(weight, heads)
    return weight


def unpermute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """q's or k's rows as transformers orders them, from llama.cpp's. RoPE turns pairs of a head's
    numbers: transformers pairs i with i + head_dim/2, llama.cpp's kernel neighbours 2i and 2i + 1,
    so its convert_hf_to_gguf.py moves row i of each head to 2i and row i + head_dim/2 to 2i + 1."""
    rows, cols = weight.shape
    return weight.view(n_head, rows // n_head // 2, 2, cols).transpose(1, 2).reshape(rows, cols)
