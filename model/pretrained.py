"""Hugging Face model folders read as our GPTConfig and weights, without transformers: GPT-2 and the
Llama family (Llama 3, Mistral, Qwen2, Qwen3).

A folder as `save_pretrained` writes it holds `config.json` and `model.safetensors` (or shards listed
in `model.safetensors.index.json`). `read_folder` turns the config into a GPTConfig, refusing in one line a
setting we do not build (another model_type, YaRN, experts, quantized weights), and the tensors
into our state dict: renamed, GPT-2's Conv1D weights transposed, and q/k/v (gate/up) fused into
the one matrix each of our layers holds. LLAMA_NAMES and LLAMA_FUSED are the Llama family's names
for both directions: model.convert writes a Llama from ours with them.

A folder is checked as our own checkpoints are, each in one line naming the file and the key or
tensor: every key we read holds its kind of value (GPT2_KEYS, LLAMA_KEYS); the family is its
model_type (else its architectures', else GPT-2's if it has GPT-2's keys); the config is compared
with the safetensors headers (shapes, no data) before any model is built or tensor read: the layer
count, then every tensor, none missing or left over, each of the shape the config gives it; and
every weight is finite. is_gpt2_bpe tells GPT-2's own tokenizer.json from any other.
"""

import json
import re
from pathlib import Path

import torch

from model.config import ROPE_SCALING_KEYS, GPTConfig, is_integer, is_real

FAMILIES = {"gpt2": "GPT-2", "llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}
# A config.json without model_type: the family its architectures name, or GPT-2 if it has GPT-2's keys.
ARCHITECTURES = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                 "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
FLOAT_DTYPES = ("F16", "BF16", "F32", "F64")  # the weights a folder may hold, as safetensors names them
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")  # (a folder with neither has no weights)
# Files of a Hugging Face folder that are not a model by themselves: the folder is (model.checkpoint.find).
FOLDER_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                "special_tokens_map.json", *WEIGHT_FILES)

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

# Every key of config.json we read, and the kind of value it must hold: one of KINDS.
KINDS = {"an integer": is_integer, "a number": is_real, "true or false": lambda v: isinstance(v, bool),
         "a string": lambda v: isinstance(v, str), "an object": lambda v: isinstance(v, dict),
         "a list of strings": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)}
FAMILY_KEYS = {"model_type": "a string", "architectures": "a list of strings"}
GPT2_KEYS = {"vocab_size": "an integer", "n_positions": "an integer", "n_layer": "an integer",
             "n_head": "an integer", "n_embd": "an integer", "n_inner": "an integer",
             "layer_norm_epsilon": "a number", "activation_function": "a string",
             "tie_word_embeddings": "true or false", "scale_attn_weights": "true or false",
             "scale_attn_by_inverse_layer_idx": "true or false", "reorder_and_upcast_attn": "true or false"}
LLAMA_KEYS = {**dict.fromkeys(["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                               "num_attention_heads", "num_key_value_heads", "head_dim",
                               "max_position_embeddings", "sliding_window", "max_window_layers",
                               *EXPERT_KEYS], "an integer"),
              **dict.fromkeys(["rms_norm_eps", "rope_theta", "partial_rotary_factor"], "a number"),
              **dict.fromkeys(["tie_word_embeddings", "mlp_bias", "attention_bias", "use_sliding_window"],
                              "true or false"),
              "hidden_act": "a string", "layer_types": "a list of strings", "rope_scaling": "an object",
              "rope_parameters": "an object", "quantization_config": "an object"}
ROPE_KEYS = {"rope_type": "a string", "type": "a string", "original_max_position_embeddings": "an integer",
             **dict.fromkeys(["rope_theta", "partial_rotary_factor", "factor", "low_freq_factor",
                              "high_freq_factor"], "a number")}
# GPTConfig's fields, by the key of config.json each is read from (Llama's, GPT-2's).
CONFIG_FIELDS = {
    False: {"vocab_size": "vocab_size", "block_size": "max_position_embeddings",
            "n_layer": "num_hidden_layers", "n_head": "num_attention_heads",
            "n_kv_head": "num_key_value_heads", "n_embd": "hidden_size", "head_dim": "head_dim",
            "mlp_hidden": "intermediate_size", "norm_eps": "rms_norm_eps", "attn_window": "sliding_window",
            "rope_base": "rope_theta", "rope_scaling": "rope_scaling"},
    True: {"vocab_size": "vocab_size", "block_size": "n_positions", "n_layer": "n_layer", "n_head": "n_head",
           "n_embd": "n_embd", "norm_eps": "layer_norm_epsilon"}}
# Null is "absent" where transformers' own default is null (a size derived from others, a feature
# off): it then means what transformers makes of it. Any other key, where present, holds a value.
NULLABLE = {"model_type", "architectures", "n_inner", "num_key_value_heads", "head_dim", "sliding_window",
            "layer_types", "partial_rotary_factor", "rope_scaling", "rope_parameters", "quantization_config",
            *EXPERT_KEYS}


def read_folder(path, dropout: float = 0.0) -> tuple[str, GPTConfig, dict]:
    """(model_type, config, state dict) of the Hugging Face folder `path`: a ValueError naming the
    file and what is wrong where it is not one we read (folder_config), or a weight is NaN or inf."""
    path = Path(path).expanduser()
    family, config = folder_config(path, dropout)
    weights = read_weights(path)
    state = gpt2_state(weights) if family == "gpt2" else llama_state(weights, config)
    return family, config, state


def folder_config(path, dropout: float = 0.0) -> tuple[str, GPTConfig]:
    """(model_type, config) of the Hugging Face folder `path`, from its config.json, checked against
    its safetensors' headers: a config the weights contradict is a ValueError, before anything is
    built or allocated from its sizes."""
    path = Path(path).expanduser()
    file = path / "config.json"
    hf = read_config(path)
    family = folder_family(hf, file)
    name = FAMILIES[family]
    check_kinds(hf, GPT2_KEYS if family == "gpt2" else LLAMA_KEYS, file)
    shapes = read_shapes(path)
    check_layer_count(hf, family, shapes, path)  # (first: a config's layers are built one by one)
    try:
        fields = gpt2_fields(hf) if family == "gpt2" else llama_fields(hf, family)
    except KeyError as e:  # a key we need, missing
        raise ValueError(f"{file} is not a {name} config (KeyError: {e.args[0]!r} is missing)") from e
    except ValueError as e:  # a setting we do not build
        raise ValueError(f"{file}: {e}") from e
    try:
        config = GPTConfig(**fields, dropout=dropout)
    except ValueError as e:  # named by our fields: which keys of config.json they are
        keys = [key for field, key in CONFIG_FIELDS[family == "gpt2"].items()
                if re.search(rf"\b{field}\b", str(e))]
        raise ValueError(f"{file}: {e}" + (f" (config.json's {', '.join(keys)})" if keys else "")) from e
    check_shapes(expected_shapes(family, config), shapes, family, config, path)
    return family, config


def folder_dtype(path) -> str:
    """The dtype the folder's config.json declares its model in (transformers' dtype, before 5
    torch_dtype): bfloat16, float16, float32..., float32 where it says none."""
    hf = read_config(Path(path).expanduser())
    dtype = hf.get("dtype", hf.get("torch_dtype"))
    return dtype.removeprefix("torch.") if isinstance(dtype, str) else "float32"


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


def folder_family(hf: dict, file: Path) -> str:
    """The family of the config.json `file` holding `hf`: its model_type; without one, what its
    architectures name (LlamaForCausalLM: llama), or GPT-2 where it has GPT-2's own keys (old
    GPT-2 configs have no model_type)."""
    check_kinds(hf, FAMILY_KEYS, file)
    family = hf.get("model_type")
    if family is None:
        archs = hf.get("architectures") or []
        named = {ARCHITECTURES[a] for a in archs if a in ARCHITECTURES}
        if not archs and {"n_embd", "n_layer", "n_head", "n_positions"} & hf.keys():
            named = {"gpt2"}
        if len(named) != 1:
            how = f"its architectures {archs} name {'more than one' if named else 'none'} of those kvgpt " \
                f"reads" if archs else "no architectures nor GPT-2's keys (n_embd, n_layer, n_head) either"
            raise ValueError(f"{file} has no model_type, and {how} (model_type {', '.join(FAMILIES)}; "
                             f"architectures {', '.join(ARCHITECTURES)})")
        family = named.pop()
    if family not in FAMILIES:
        raise ValueError(f"{file}: model_type={family!r} is not supported (kvgpt reads "
                         f"{', '.join(FAMILIES)})")
    return family


def check_kinds(hf: dict, kinds: dict, file: Path, within: str = "") -> None:
    """Each key of `kinds` that `hf` holds is of its kind (null, where NULLABLE, is absent), else a
    ValueError naming the file and the key; with `within`, the keys of that object of config.json."""
    for key, kind in kinds.items():
        if key not in hf or hf[key] is None and key in NULLABLE:
            continue
        if not KINDS[kind](hf[key]):
            null = " or null" if key in NULLABLE else ""
            raise ValueError(f"{file}: {within}{key} must be {kind}{null}, got {json.dumps(hf[key])[:60]}")
    for key in ("rope_scaling", "rope_parameters"):
        if not within and isinstance(hf.get(key), dict) and key in kinds:
            check_kinds(hf[key], ROPE_KEYS, file, f"{key}.")


def weight_files(path: Path) -> list[str]:
    """The folder's safetensors: model.safetensors, or the shards its index lists."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = json.loads(index.read_text())["weight_map"].values()
        except (ValueError, OSError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"{index} is not a safetensors index ({type(e).__name__}: {e})") from e
        if not files or not all(isinstance(f, str) and f == Path(f).name for f in files):
            raise ValueError(f"{index} is not a safetensors index (its weight_map must name a file of this "
                             f"folder for each tensor)")
        return sorted(set(files))
    if (path / "model.safetensors").is_file():
        return ["model.safetensors"]
    raise ValueError(f"{path} has no weights (model.safetensors, or model.safetensors.index.json)")


def read_shapes(path: Path) -> dict[str, tuple[str, tuple]]:
    """{tensor name: (its file, its shape)} of every tensor of the folder's safetensors, from their
    headers alone (no data read): a tensor in two files is refused."""
    from safetensors import safe_open

    shapes = {}
    for file in weight_files(path):
        try:
            with safe_open(path / file, framework="pt") as f:
                header = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
                dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
        except Exception as e:  # noqa: BLE001  safetensors' own error for a damaged file, or an OSError
            raise ValueError(f"{path / file} cannot be read ({type(e).__name__}: {e})") from e
        if other := next((name for name, dtype in dtypes.items() if dtype not in FLOAT_DTYPES), None):
            raise ValueError(f"{path / file}: {other} holds {dtypes[other]} numbers, not float weights "
                             f"(kvgpt reads {', '.join(FLOAT_DTYPES)}; quantized folders are not read)")
        if twice := sorted(header.keys() & shapes.keys()):
            raise ValueError(f"{path / file}: {twice[0]} is in {shapes[twice[0]][0]} too (a tensor is in one "
                             f"file of a folder)")
        shapes |= {name: (file, shape) for name, shape in header.items()}
    return shapes


def read_weights(path: Path) -> dict:
    """Every tensor of the folder's safetensors, each checked finite (as model.checkpoint checks
    ours): a NaN or inf is a ValueError naming the file and the tensor."""
    from safetensors.torch import load_file

    weights = {}
    for file in weight_files(path):
        try:
            tensors = load_file(path / file)
        except Exception as e:  # noqa: BLE001  safetensors' own error for a damaged file, or an OSError
            raise ValueError(f"{path / file} cannot be read ({type(e).__name__}: {e})") from e
        for name, tensor in tensors.items():
            if not is_finite(tensor):
                raise ValueError(f"{path / file}: its weights hold NaN or inf ({name}): a damaged file")
        weights |= tensors
    return weights


def is_finite(tensor: torch.Tensor) -> bool:
    """Every number of `tensor` finite (a folder's weights, and our checkpoints': model.checkpoint).
    Its least and greatest (NaN, where there is one) say so in one
    pass that allocates nothing: ~0.1 s of one core for 135M float32, a tenth of isfinite().all()'s."""
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return True
    if tensor.element_size() == 1:  # (float8: no min/max kernel of its own)
        tensor = tensor.float()
    low, high = torch.aminmax(tensor)
    return bool(torch.isfinite(low) & torch.isfinite(high))


def check_layer_count(hf: dict, family: str, shapes: dict, path: Path) -> None:
    """The layers config.json gives are those the weights hold (numbered 0 to n - 1)."""
    key, prefix = ("n_layer", "h.") if family == "gpt2" else ("num_hidden_layers", "model.layers.")
    n_layer = hf.get(key)
    if n_layer is None:
        return  # (a KeyError, named with the other keys)
    layers = set()
    for name in shapes:
        number = name.removeprefix("transformer.").removeprefix(prefix).split(".")[0]
        if name.removeprefix("transformer.").startswith(prefix) and number.isdigit():
            layers.add(int(number))
    held = max(layers) + 1 if layers else 0
    if n_layer != held:
        raise ValueError(f"{path}: weights do not match its config.json ({key}={n_layer}, but the weights "
                         f"hold {held} layers)")


def expected_shapes(family: str, c: GPTConfig) -> dict[str, tuple]:
    """The tensors a folder of `family` with config `c` holds (their names in the folder; GPT-2's
    without `transformer.`), each shape as (size, what config.json calls it) for each dimension."""
    vocab, width = (c.vocab_size, "vocab_size"), (c.n_embd, "n_embd" if family == "gpt2" else "hidden_size")
    if family == "gpt2":
        wide, wider = (3 * c.n_embd, "3 x n_embd"), (4 * c.n_embd, "4 x n_embd")
        layer = {f"{norm}.{kind}": (width,) for norm in ("ln_1", "ln_2") for kind in ("weight", "bias")}
        layer |= {"attn.c_attn.weight": (width, wide), "attn.c_attn.bias": (wide,),
                  "attn.c_proj.weight": (width, width), "attn.c_proj.bias": (width,),
                  "mlp.c_fc.weight": (width, wider), "mlp.c_fc.bias": (wider,),
                  "mlp.c_proj.weight": (wider, width), "mlp.c_proj.bias": (width,)}  # (Conv1D: in, out)
        outer = {"wte.weight": (vocab, width), "wpe.weight": ((c.block_size, "n_positions"), width),
                 "ln_f.weight": (width,), "ln_f.bias": (width,)}
        return outer | {f"h.{i}.{name}": shape for i in range(c.n_layer) for name, shape in layer.items()}
    q = (c.n_head * c.head_dim, "num_attention_heads x head_dim")
    kv = (c.n_kv_head * c.head_dim, "num_key_value_heads x head_dim")
    hidden = (c.mlp_width, "intermediate_size")
    layer = {"input_layernorm.weight": (width,), "post_attention_layernorm.weight": (width,),
             "self_attn.q_proj.weight": (q, width), "self_attn.k_proj.weight": (kv, width),
             "self_attn.v_proj.weight": (kv, width), "self_attn.o_proj.weight": (width, q),
             "mlp.gate_proj.weight": (hidden, width), "mlp.up_proj.weight": (hidden, width),
             "mlp.down_proj.weight": (width, hidden)}
    if c.qkv_bias:  # (Qwen2's)
        layer |= {f"self_attn.{n}_proj.bias": (size,) for n, size in (("q", q), ("k", kv), ("v", kv))}
    if c.qk_norm:  # (Qwen3's)
        layer |= {f"self_attn.{n}_norm.weight": ((c.head_dim, "head_dim"),) for n in "qk"}
    outer = {"model.embed_tokens.weight": (vocab, width), "model.norm.weight": (width,)}
    if not c.tie_embeddings:
        outer["lm_head.weight"] = (vocab, width)
    return outer | {f"model.layers.{i}.{name}": shape for i in range(c.n_layer)
                    for name, shape in layer.items()}


def check_shapes(expected: dict, shapes: dict, family: str, c: GPTConfig, path: Path) -> None:
    """The folder's tensors (`shapes`, read_shapes') are those `expected` (expected_shapes'), each of
    its shape; what our state dicts leave out (causal-mask buffers, RoPE's inverse frequencies, a tied
    head) may be there too."""
    found = {}
    for name, (file, shape) in shapes.items():
        key = name.removeprefix("transformer.") if family == "gpt2" else name
        if family == "gpt2":
            ignored = key.endswith((".attn.bias", ".attn.masked_bias")) or key == "lm_head.weight"
        else:
            ignored = key.endswith("rotary_emb.inv_freq") or c.tie_embeddings and key == "lm_head.weight"
        if not ignored:  # (GPT-2's name with `transformer.` and without, both: the second is unexpected)
            found[key if key not in found else name] = (name, file, shape)
    if differ := tensors_differ(expected, found, lambda key: found[key][0]):
        raise ValueError(f"{path}: weights do not match its config.json (a {FAMILIES[family]} of its config "
                         f"has other tensors: {differ})")
    for key, sizes in expected.items():
        name, file, shape = found[key]
        if shape != tuple(size for size, _ in sizes):
            raise ValueError(f"{path}: weights do not match its config.json ({name} in {file} is "
                             f"{list(shape)}, its config makes it [{sizes_made(sizes)}])")


def tensors_differ(expected: dict, found: dict, name=str) -> str:
    """'' where `found` has exactly `expected`'s keys, else how it differs, e.g. '2 missing (first a),
    1 unexpected (first b)' (`name`: how a found key is named)."""
    missing, unexpected = sorted(expected.keys() - found.keys()), sorted(found.keys() - expected.keys())
    what = [f"{len(missing)} missing (first {missing[0]})"] if missing else []
    what += [f"{len(unexpected)} unexpected (first {name(unexpected[0])})"] if unexpected else []
    return ", ".join(what)


def sizes_made(sizes) -> str:
    """'hidden_size=48, vocab_size=300': a tensor's shape as (size, what the config calls it) pairs."""
    return ", ".join(f"{what}={size}" for size, what in sizes)


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
            "n_kv_head": hf["num_attention_heads"] if hf.get("num_key_value_heads") is None
            else hf["num_key_value_heads"],  # (null: as many as the heads)
            "n_embd": hf["hidden_size"], "head_dim": hf.get("head_dim"),  # (null: hidden_size / heads)
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
    if set(rope) & {"full_attention", "sliding_attention"}:
        raise ValueError(f"unsupported {name} config: {key} per layer type (kvgpt builds one RoPE)")
    kind = rope.get("rope_type", rope.get("type", "default"))
    partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    partial = 1.0 if partial is None else partial
    if kind not in ("default", "llama3") or partial != 1.0:
        what = f"rope_type={kind!r}" if partial == 1.0 else f"partial_rotary_factor={partial!r}"
        raise ValueError(f"unsupported {name} config: {key} {what} (kvgpt builds RoPE over whole heads, "
                         f"plain or with Llama 3's scaling)")
    scaling = None
    if kind == "llama3":
        rope = {"original_max_position_embeddings": hf["max_position_embeddings"]} | rope
        if missing := [k for k in ROPE_SCALING_KEYS if k not in rope]:
            raise KeyError(f"{key}.{missing[0]}")
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
