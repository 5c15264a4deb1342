"""Hugging Face model folders read as our config and weights, without transformers: GPT-2 and the
Llama family (Llama 3, Mistral, Qwen2, Qwen3).

A folder as `save_pretrained` writes it holds `config.json` and `model.safetensors` (or shards listed
in `model.safetensors.index.json`). `read_folder` turns the config into a GPTConfig, refusing in one line a
setting we do not build (another model_type, YaRN, experts, quantized weights), and the tensors
into our state dict: renamed, GPT-2's Conv1D weights transposed, and q/k/v (gate/up) fused into
the one matrix each of our layers holds. LLAMA_NAMES and LLAMA_FUSED are the Llama family's names
for both directions: model.convert writes a Llama from ours with them.
"""

import json
from pathlib import Path

import torch

from model.config import ROPE_SCALING_KEYS, GPTConfig

FAMILIES = {"gpt2": "GPT-2", "llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}

# The Llama family's weights. Outside the layers, ours: theirs; in layer i (theirs under
# model.layers.<i>., ours under blocks.<i>.), the same, and the matrices we fuse: ours is theirs
# stacked along the output rows, in this order ([q, k, v]; SwiGLU's [gate, up]).
LLAMA_OUTER = {"wte.weight": "model.embed_tokens.weight", "norm_f.weight": "model.norm.weight",
               "lm_head.weight": "lm_head.weight"}
LLAMA_NAMES = {"norm_1.weight": "input_layernorm.weight", "norm_2.weight": "post_attention_layernorm.weight",
               "attn.proj.weight": "self_attn.o_proj.weight", "mlp.proj.weight": "mlp.down_proj.weight",
               "attn.q_norm.weight": "self_attn.q_norm.weight",
               "attn.k_norm.weight": "self_attn.k_norm.weight"}
LLAMA_FUSED = {"attn.qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
               "mlp.fc": ("mlp.gate_proj", "mlp.up_proj")}

# What transformers takes for a key a Llama-family config.json leaves out, where it changes the model.
LLAMA_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048},
    "mistral": {"num_key_value_heads": 8, "sliding_window": 4096, "max_position_embeddings": 131072},
    "qwen2": {"num_key_value_heads": 32, "max_position_embeddings": 32768},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768},
}
# Settings we build only at one value (absent: that value), by the families that read them.
LLAMA_FIXED = {"hidden_act": ("silu", FAMILIES), "mlp_bias": (False, ["llama"]),
               "attention_bias": (False, ["llama", "qwen3"])}
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok")


def read_folder(path, dropout: float = 0.0) -> tuple[str, GPTConfig, dict]:
    """(model_type, config, state dict) of the Hugging Face folder `path`: a ValueError naming the
    file and what is wrong where it is not one we read."""
    path = Path(path).expanduser()
    family, config = folder_config(path, dropout)
    weights = read_weights(path)
    state = gpt2_state(weights) if family == "gpt2" else llama_state(weights, config)
    return family, config, state


def folder_config(path, dropout: float = 0.0) -> tuple[str, GPTConfig]:
    """(model_type, config) of the Hugging Face folder `path`, read from its config.json alone."""
    path = Path(path).expanduser()
    hf = read_config(path)
    family = hf.get("model_type", "gpt2")  # (GPT-2 configs of old name none)
    if family not in FAMILIES:
        raise ValueError(f"{path / 'config.json'}: model_type={family!r} is not supported (kvgpt reads "
                         f"{', '.join(FAMILIES)})")
    try:
        fields = gpt2_fields(hf) if family == "gpt2" else llama_fields(hf, family)
    except (KeyError, TypeError) as e:  # a key missing, a value of the wrong kind
        raise ValueError(f"{path / 'config.json'} is not a {FAMILIES[family]} config "
                         f"({type(e).__name__}: {e})") from e
    try:
        return family, GPTConfig(**fields, dropout=dropout)
    except ValueError as e:
        raise ValueError(f"{path / 'config.json'}: {e}") from e


def read_config(path: Path) -> dict:
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is not a Hugging Face model folder (no config.json)")
    try:
        hf = json.loads((path / "config.json").read_text())
    except (ValueError, OSError) as e:
        raise ValueError(f"{path / 'config.json'} is not a Hugging Face config "
                         f"({type(e).__name__}: {e})") from e
    if not isinstance(hf, dict):
        raise ValueError(f"{path / 'config.json'} is not a Hugging Face config (a {type(hf).__name__})")
    return hf


def read_weights(path: Path) -> dict:
    """Every tensor of the folder's safetensors: model.safetensors, or the shards its index lists."""
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index} is not a safetensors index ({type(e).__name__}: {e})") from e
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{path} has no weights (model.safetensors, or model.safetensors.index.json)")
    weights = {}
    for name in files:
        try:
            weights |= load_file(path / name)
        except Exception as e:  # noqa: BLE001  safetensors' own error for a damaged file, or an OSError
            raise ValueError(f"{path / name} cannot be read ({type(e).__name__}: {e})") from e
    return weights


def gpt2_fields(hf: dict) -> dict:
    """GPTConfig's fields of a GPT-2 config.json: our defaults are GPT-2's architecture."""
    supported = {"activation_function": "gelu_new", "n_inner": None, "scale_attn_weights": True,
                 "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
                 "tie_word_embeddings": True}
    for field, value in supported.items():
        if hf.get(field, value) != value:
            raise ValueError(f"unsupported GPT-2 config: {field}={hf[field]!r} (supported: {value!r})")
    return {"vocab_size": hf["vocab_size"], "block_size": hf["n_positions"], "n_layer": hf["n_layer"],
            "n_head": hf["n_head"], "n_embd": hf["n_embd"], "norm_eps": hf.get("layer_norm_epsilon", 1e-5)}


def gpt2_state(weights: dict) -> dict:
    """Our state dict from GPT-2's tensors: GPT-2's Conv1D stores (in, out), nn.Linear (out, in)."""
    renames = {"ln_1": "norm_1", "ln_2": "norm_2", "attn.c_attn": "attn.qkv",
               "attn.c_proj": "attn.proj", "mlp.c_fc": "mlp.fc", "mlp.c_proj": "mlp.proj"}
    state = {}
    for key, tensor in weights.items():
        key = key.removeprefix("transformer.")
        if key.endswith((".attn.bias", ".attn.masked_bias")) or key == "lm_head.weight":
            continue  # causal-mask buffers of old checkpoints; the head is tied to wte
        name = key.replace("h.", "blocks.", 1).replace("ln_f.", "norm_f.")
        for old, new in renames.items():
            name = name.replace(f".{old}.", f".{new}.")
        is_conv1d = name.endswith(".weight") and any(f".{n}." in name for n in renames.values()
                                                      if "norm" not in n)
        state[name] = tensor.t() if is_conv1d else tensor
    return state


def llama_fields(hf: dict, family: str) -> dict:
    """GPTConfig's fields of a Llama-family config.json (a pre-norm RMSNorm, SwiGLU, RoPE decoder;
    Qwen2 with biases on q, k, v; Qwen3 with each head's q and k normed)."""
    hf = LLAMA_DEFAULTS[family] | hf
    name = FAMILIES[family]
    for key, (value, families) in LLAMA_FIXED.items():
        if family in families and hf.get(key, value) != value:
            raise ValueError(f"unsupported {name} config: {key}={hf[key]!r} (kvgpt builds {value!r})")
    for key in [*EXPERT_KEYS, "quantization_config"]:
        if hf.get(key):
            raise ValueError(f"unsupported {name} config: {key}={hf[key]!r} (kvgpt builds dense layers "
                             f"of float weights)")
    window, pattern = llama_windows(hf, family)
    return {"vocab_size": hf["vocab_size"], "block_size": hf["max_position_embeddings"],
            "n_layer": hf["num_hidden_layers"], "n_head": hf["num_attention_heads"],
            "n_kv_head": hf.get("num_key_value_heads") or hf["num_attention_heads"],
            "n_embd": hf["hidden_size"], "head_dim": hf.get("head_dim") or None,
            "mlp_hidden": hf["intermediate_size"], "norm_eps": hf.get("rms_norm_eps", 1e-6),
            "tie_embeddings": hf.get("tie_word_embeddings", False), "pos_emb": "rope", "norm": "rmsnorm",
            "mlp": "swiglu", "bias": False, "qkv_bias": True if family == "qwen2" else None,
            "qk_norm": family == "qwen3", "attn_window": window, "window_pattern": pattern,
            **llama_rope(hf, name)}


def llama_rope(hf: dict, name: str) -> dict:
    """rope_base and rope_scaling from rope_parameters (transformers 5) or rope_theta and
    rope_scaling (before): the default RoPE, or Llama 3's scaling."""
    key = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
    rope = hf.get(key) or {}
    if not isinstance(rope, dict):
        raise TypeError(f"{key} is a {type(rope).__name__}, not a dict")
    if set(rope) & {"full_attention", "sliding_attention"}:
        raise ValueError(f"unsupported {name} config: {key} per layer type (kvgpt builds one RoPE)")
    kind = rope.get("rope_type", rope.get("type", "default"))
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor")) or 1.0
    if kind not in ("default", "llama3") or partial != 1.0:
        what = f"rope_type={kind!r}" if partial == 1.0 else f"partial_rotary_factor={partial!r}"
        raise ValueError(f"unsupported {name} config: {key} {what} (kvgpt builds RoPE over whole heads, "
                         f"plain or with Llama 3's scaling)")
    scaling = None
    if kind == "llama3":
        rope = {"original_max_position_embeddings": hf["max_position_embeddings"]} | rope
        scaling = [rope[k] for k in ROPE_SCALING_KEYS]
    return {"rope_base": rope.get("rope_theta", hf.get("rope_theta", 10000.0)), "rope_scaling": scaling}


def llama_windows(hf: dict, family: str) -> tuple[int | None, str | None]:
    """(attn_window, window_pattern): Mistral's sliding_window in every layer; Qwen's where
    use_sliding_window, in the layers its layer_types call sliding (by default those from
    max_window_layers on). A window as long as the context is none."""
    slides = family == "mistral" or family in ("qwen2", "qwen3") and hf.get("use_sliding_window")
    window = hf.get("sliding_window") if slides else None
    if window is None or window >= hf["max_position_embeddings"]:  # (as long as the context: no window)
        return None, None
    if family == "mistral":
        return window, None
    n_layer, first = hf["num_hidden_layers"], hf.get("max_window_layers", 28)
    types = hf.get("layer_types") or ["sliding_attention" if i >= first else "full_attention"
                                      for i in range(n_layer)]
    if len(types) != n_layer or set(types) - {"sliding_attention", "full_attention"}:
        raise ValueError(f"unsupported {FAMILIES[family]} config: layer_types={types} (kvgpt builds one of "
                         f"sliding_attention or full_attention for each of the {n_layer} layers)")
    pattern = "".join("S" if t == "sliding_attention" else "L" for t in types)
    if "S" not in pattern:
        return None, None
    return window, None if set(pattern) == {"S"} else pattern


def llama_state(weights: dict, config: GPTConfig) -> dict:
    """Our state dict from a Llama-family folder's tensors: renamed, q/k/v and gate/up fused. A tied
    head (tie_embeddings) is the embedding: a stored lm_head is left out."""
    weights = {k: v for k, v in weights.items() if not k.endswith("rotary_emb.inv_freq")}  # old buffers
    state = {ours: weights.pop(theirs) for ours, theirs in LLAMA_OUTER.items() if theirs in weights}
    if config.tie_embeddings:
        state.pop("lm_head.weight", None)
    for i in range(config.n_layer):
        layer = f"model.layers.{i}."
        for ours, theirs in LLAMA_NAMES.items():
            if layer + theirs in weights:
                state[f"blocks.{i}.{ours}"] = weights.pop(layer + theirs)
        for ours, parts in LLAMA_FUSED.items():
            for kind in ("weight", "bias"):
                names = [f"{layer}{part}.{kind}" for part in parts if f"{layer}{part}.{kind}" in weights]
                if names:  # (sum of their rows, ...)
                    state[f"blocks.{i}.{ours}.{kind}"] = torch.cat([weights.pop(name) for name in names])
    state |= weights  # what is left has no name of ours: GPT.from_pretrained names it
    return state
