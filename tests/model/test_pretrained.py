"""Hugging Face folders of the Llama family (model/pretrained.py): each family's random model as
transformers writes it loads exactly (logits, greedy tokens with our cache and without), its
config fields read as transformers reads them, and what we do not build refused in one line; a
hostile folder (GPT-2's too) refused as our checkpoints are: a value of the wrong kind, a config its
weights contradict (before anything is built), a NaN or inf; GPT-2's own tokenizer.json told apart."""

import json
import math
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from model import GPT, GPTConfig, generate
from model.loading import load_model
from model.pretrained import (
    GPT2_KEYS,
    LLAMA_KEYS,
    NULLABLE,
    ROPE_KEYS,
    folder_config,
    gpt2_fields,
    llama_fields,
)
from tests.helpers import (
    HF_FAMILIES,
    assert_one_line_error,
    hf_folder,
    hf_gpt2,
    run_in_process,
)

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_each_family_matches_transformers(hf_folders, family):
    """Logits within 1e-4 in float32 over 60 positions (past Qwen3's and Mistral's window of 6, past
    Llama 3's original 48), and transformers' greedy tokens, 80 of them, with our cache and without."""
    path, hf = hf_folders[family]
    ours = GPT.from_pretrained(path).eval()
    idx = torch.randint(0, 300, (2, 60), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(idx).logits
        torch.testing.assert_close(ours(idx), expected, atol=1e-4, rtol=0)
    assert expected.abs().max() > 1  # logits of order 1: a weight mapped wrongly would show
    tokens = hf.generate(idx[:, :5], max_new_tokens=80, min_new_tokens=80, do_sample=False)
    for kv_cache in (True, False):
        assert torch.equal(generate(ours, idx[:, :5], 80, temperature=0, kv_cache=kv_cache), tokens)


def test_the_fields_real_models_set_are_read(hf_folders):
    c = {family: GPT.from_pretrained(path).config for family, (path, _) in hf_folders.items()}
    for family, config in c.items():
        assert (config.n_embd, config.n_head, config.n_kv_head) == (48, 4, 2)
        assert config.head_dim == (12 if family == "mistral" else 16)  # Mistral's: none in its config.json
        assert (config.mlp_hidden, config.norm_eps, config.block_size) == (80, 1e-5, 96)
        assert (config.pos_emb, config.norm, config.mlp, config.bias) == ("rope", "rmsnorm", "swiglu", False)
    assert c["llama"].rope_base == 500000.0 and c["llama"].rope_scaling == [8.0, 1.0, 4.0, 48.0]
    assert c["qwen3"].rope_base == 1e6 and c["qwen3"].rope_scaling is None and c["qwen3"].qk_norm
    assert (c["qwen3"].attn_window, c["qwen3"].window_pattern) == (6, "SLS")
    assert (c["mistral"].attn_window, c["mistral"].window_pattern) == (6, None)
    assert c["qwen2"].qkv_bias and c["qwen2"].tie_embeddings and c["qwen2"].attn_window is None
    assert [c[f].tie_embeddings for f in ("llama", "qwen3", "mistral")] == [False] * 3


def test_the_new_fields_default_to_todays_model():
    """Every new field left out builds the model as before: the same parameters, the same numbers."""
    old = GPTConfig(vocab_size=37, block_size=24, n_layer=2, n_head=4, n_embd=16, pos_emb="rope",
                    mlp="swiglu")
    assert (old.head_dim, old.mlp_width, old.rope_base) == (4, 48, 10000.0)
    assert old.rope_scaling is None and old.qkv_bias is None
    assert GPTConfig(n_embd=16, n_head=4).mlp_width == 64
    torch.manual_seed(0)
    model = GPT(old)
    assert model.blocks[0].attn.qkv.weight.shape == (16 + 2 * 16, 16) and model.rope == (4, 10000.0, None)


@pytest.mark.parametrize("field,value", [
    ("rope_base", 1.0), ("rope_base", float("inf")), ("rope_base", True), ("rope_scaling", [8.0, 1.0, 4.0]),
    ("rope_scaling", [8.0, 4.0, 1.0, 8.0]), ("rope_scaling", [8.0, 1.0, 4.0, -1.0]), ("rope_scaling", "abcd"),
    ("head_dim", 0), ("mlp_hidden", 0), ("qkv_bias", "yes"), ("head_dim", 7)])
def test_invalid_new_fields_fail_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"GPTConfig\.{field}"):
        GPTConfig(pos_emb="rope", **{field: value})


def write_config(path, **changes):
    """config.json with `changes`, a key whose value is DROP left out."""
    config = json.loads((path / "config.json").read_text()) | changes
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v != DROP}))


DROP = "(left out)"


@pytest.mark.parametrize("family,changes,message", [
    ("llama", {"model_type": "mixtral"}, r"model_type='mixtral' is not supported \(kvgpt reads gpt2, llama"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
     r"unsupported Llama config: rope_parameters rope_type='yarn'"),
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     r"unsupported Llama config: rope_parameters partial_rotary_factor=0.5"),
    ("qwen3", {"num_experts": 8}, r"unsupported Qwen3 config: num_experts=8"),
    ("llama", {"attention_bias": True}, r"unsupported Llama config: attention_bias=True"),
    ("mistral", {"hidden_act": "gelu"}, r"unsupported Mistral config: hidden_act='gelu'"),
    ("qwen2", {"quantization_config": {"quant_method": "awq"}},
     r"unsupported Qwen2 config: quantization_config="),
    ("qwen3", {"layer_types": ["full_attention"]},
     r"unsupported Qwen3 config: layer_types=\['full_attention'\]"),
    ("llama", {"rope_scaling": "llama3"}, r'config.json: rope_scaling must be an object or null, got "llama'),
    ("qwen3", {"hidden_size": DROP}, r"config.json is not a Qwen3 config \(KeyError: 'hidden_size'"),
    ("qwen3", {"hidden_size": None}, r"config.json: hidden_size must be an integer, got null"),
    ("llama", {"num_attention_heads": 5}, r"config.json: GPTConfig.n_kv_head=2 must divide n_head=5 "
                                          r"\(config.json's num_attention_heads, num_key_value_heads\)"),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5}},
     r"is not a Llama config \(KeyError: 'rope_parameters.factor' is missing"),
])
def test_an_unsupported_config_fails_in_one_line_naming_the_key(tmp_path, family, changes, message):
    hf_folder(tmp_path, family)
    write_config(tmp_path, **changes)
    with pytest.raises(ValueError, match=message) as error:
        GPT.from_pretrained(tmp_path)
    assert "\n" not in str(error.value)


def test_the_older_config_format_reads_the_same(hf_folders, tmp_path):
    """rope_theta and rope_scaling beside the other keys (transformers 4, most folders on the Hub)
    build what rope_parameters (transformers 5) builds."""
    path, _ = hf_folders["llama"]
    config = json.loads((path / "config.json").read_text())
    rope = config.pop("rope_parameters")  # {rope_type: llama3, ..., rope_theta: 500000.0}
    legacy = config | {"rope_theta": rope["rope_theta"],
                       "rope_scaling": {k: v for k, v in rope.items() if k != "rope_theta"}}
    assert llama_fields(legacy, "llama") == llama_fields(config | {"rope_parameters": rope}, "llama")
    assert llama_fields(legacy, "llama")["rope_base"] == 500000.0


def test_qwen_layer_types_default_from_max_window_layers():
    """Without layer_types, Qwen's sliding layers are those from max_window_layers on, and only with
    use_sliding_window; Mistral slides in every layer; defaults as transformers' classes have them."""
    base = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 4,
            "num_attention_heads": 2, "max_window_layers": 1, "sliding_window": 3}
    assert llama_fields(base | {"use_sliding_window": True}, "qwen2")["window_pattern"] == "LSSS"
    assert llama_fields(base, "qwen2")["attn_window"] is None
    none_sliding = base | {"use_sliding_window": True, "max_window_layers": 4}
    assert llama_fields(none_sliding, "qwen3")["attn_window"] is None
    assert llama_fields({**base, "sliding_window": None}, "mistral")["attn_window"] is None
    assert llama_fields(base, "mistral")["attn_window"] == 3
    assert llama_fields(base | {"max_position_embeddings": 3}, "mistral")["attn_window"] is None  # all of it
    assert llama_fields(base, "qwen3")["head_dim"] == 128 and llama_fields(base, "qwen3")["n_kv_head"] == 32
    assert llama_fields(base, "llama")["n_kv_head"] == 2


def test_sharded_weights_load(tmp_path, hf_folders):
    """A folder whose weights are split in shards (model.safetensors.index.json) loads the same."""
    _, hf = hf_folders["qwen2"]
    hf.save_pretrained(tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    idx = torch.randint(0, 300, (1, 12))
    with torch.no_grad():
        ours = GPT.from_pretrained(tmp_path).eval()(idx)
        torch.testing.assert_close(ours, hf(idx).logits, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def folders(hf_folders, tmp_path_factory) -> dict:
    """{family: folder}: the Llama families' (hf_folders) and a GPT-2's (hf_gpt2), without a tokenizer."""
    gpt2 = tmp_path_factory.mktemp("gpt2")
    hf_gpt2(gpt2)
    return {"gpt2": gpt2} | {family: path for family, (path, _) in hf_folders.items()}


def copy_folder(source, path, **changes):
    """A copy of the folder `source` at `path`, its config.json with `changes` (write_config's)."""
    shutil.copytree(source, path)
    write_config(path, **changes)
    return path


def change_weights(path, change, file="model.safetensors"):
    """`change(weights)` applied to the tensors of the folder's `file`, written back."""
    weights = load_file(path / file)
    change(weights)
    save_file(weights, path / file, metadata={"format": "pt"})


def assert_one_line(error, *parts):
    message = str(error.value)
    assert "\n" not in message and all(part in message for part in parts), message


@pytest.mark.parametrize("family,key,value,named", [
    ("llama", "intermediate_size", 2**36, "[intermediate_size=68719476736, hidden_size=48]"),
    ("llama", "num_hidden_layers", 10**6, "num_hidden_layers=1000000, but the weights hold 3 layers"),
    ("llama", "num_hidden_layers", 2, "num_hidden_layers=2, but the weights hold 3 layers"),
    ("llama", "vocab_size", 2**40, "[vocab_size=1099511627776, hidden_size=48]"),
    ("llama", "hidden_size", 64, "[vocab_size=300, hidden_size=64]"),
    ("llama", "head_dim", 32, "[num_attention_heads x head_dim=128, hidden_size=48]"),
    ("llama", "num_key_value_heads", None, "[num_key_value_heads x head_dim=64, hidden_size=48]"),
    ("qwen3", "num_attention_heads", 8, "[num_attention_heads x head_dim=128, hidden_size=48]"),
    ("qwen2", "tie_word_embeddings", False, "1 missing (first lm_head.weight)"),
    ("qwen3", "model_type", "llama", "unexpected (first model.layers.0.self_attn.k_norm.weight)"),
    ("mistral", "head_dim", 16, "[num_attention_heads x head_dim=64, hidden_size=48]"),
    ("gpt2", "n_layer", 10**6, "n_layer=1000000, but the weights hold 2 layers"),
    ("gpt2", "n_embd", 64, "[vocab_size=97, n_embd=64]"),
    ("gpt2", "n_positions", 2**40, "[n_positions=1099511627776, n_embd=32]"),
])
def test_a_config_its_weights_contradict_is_refused_before_any_model_is_built(
        tmp_path, folders, family, key, value, named):
    """Every size of config.json is compared with the safetensors' headers first: load_model, which
    builds the model on the meta device to count its parameters, refuses a million layers (38
    minutes to build) or an MLP 2^36 wide (the allocator's traceback) in one line, at once."""
    path = copy_folder(folders[family], tmp_path / "folder", **{key: value})
    for read in (folder_config, lambda p: load_model(p, "cpu")):
        with pytest.raises(ValueError, match="weights do not match its config.json") as error:
            read(path)
        assert_one_line(error, named)


@pytest.mark.parametrize("change,named", [
    (lambda w: w.pop("model.layers.1.self_attn.k_proj.weight"),
     "1 missing (first model.layers.1.self_attn.k_proj.weight)"),
    (lambda w: w.update(extra=torch.ones(2)), "1 unexpected (first extra)"),
    (lambda w: w.update({"model.layers.2.mlp.down_proj.weight": torch.ones(48, 79)}),
     "model.layers.2.mlp.down_proj.weight in model.safetensors is [48, 79], its config makes it "
     "[hidden_size=48, intermediate_size=80]"),
    (lambda w: w.update({"model.layers.3.input_layernorm.weight": torch.ones(48)}),
     "num_hidden_layers=3, but the weights hold 4 layers"),
])
def test_a_weight_missing_left_over_or_of_another_shape_is_named(tmp_path, folders, change, named):
    path = copy_folder(folders["llama"], tmp_path / "folder")
    change_weights(path, change)
    with pytest.raises(ValueError, match="weights do not match its config.json") as error:
        GPT.from_pretrained(path)
    assert_one_line(error, named)


@pytest.mark.parametrize("dtype,named", [(torch.int32, "I32"), (torch.int8, "I8"), (torch.bool, "BOOL"),
                                         (torch.float8_e4m3fn, "F8_E4M3")])
def test_weights_that_are_not_floats_are_refused_before_any_model_is_built(tmp_path, folders, dtype, named):
    """A tensor of integers, booleans or a quantized float of the right shape would be cast silently
    by load_state_dict: its header's dtype is read with its shape, and refused, naming file and tensor."""
    path = copy_folder(folders["llama"], tmp_path / "folder")
    change_weights(path, lambda w: w.update({"model.norm.weight": w["model.norm.weight"].to(dtype)}))
    with pytest.raises(ValueError, match=f"holds {named} numbers, not float weights") as error:
        folder_config(path)
    assert_one_line(error, f"{path / 'model.safetensors'}: model.norm.weight")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_nan_or_inf_in_a_folder_is_refused_naming_the_file_and_the_tensor(tmp_path, folders, dtype, value):
    """As our own checkpoints are (model.checkpoint.check_weights): one number anywhere, here the
    last of the last layer's, in the folder's dtype."""
    path = copy_folder(folders["llama"], tmp_path / "folder")

    def spoil(weights):
        weights.update({name: tensor.to(dtype) for name, tensor in weights.items()})
        weights["model.layers.2.mlp.down_proj.weight"][-1, -1] = value

    change_weights(path, spoil)
    with pytest.raises(ValueError, match="its weights hold NaN or inf") as error:
        GPT.from_pretrained(path)
    assert_one_line(error, f"{path / 'model.safetensors'}:", "(model.layers.2.mlp.down_proj.weight)")


def test_a_nan_in_a_shard_is_refused_naming_the_shard(tmp_path, hf_folders):
    _, hf = hf_folders["qwen2"]
    hf.save_pretrained(tmp_path, max_shard_size="50KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    shard = index["model.layers.1.self_attn.q_proj.bias"]
    change_weights(tmp_path, lambda w: w["model.layers.1.self_attn.q_proj.bias"].fill_(math.nan), shard)
    with pytest.raises(ValueError, match="its weights hold NaN or inf") as error:
        GPT.from_pretrained(tmp_path)
    assert_one_line(error, f"{tmp_path / shard}:", "(model.layers.1.self_attn.q_proj.bias)")


@pytest.mark.parametrize("family,changes,message", [
    ("llama", {"rms_norm_eps": "1e-5"}, 'rms_norm_eps must be a number, got "1e-5"'),
    ("gpt2", {"layer_norm_epsilon": None}, "layer_norm_epsilon must be a number, got null"),
    ("llama", {"model_type": ["llama"]}, 'model_type must be a string or null, got ["llama"]'),
    ("llama", {"hidden_size": 48.0}, "hidden_size must be an integer, got 48.0"),
    ("qwen3", {"num_hidden_layers": True}, "num_hidden_layers must be an integer, got true"),
    ("qwen2", {"tie_word_embeddings": "true"}, 'tie_word_embeddings must be true or false, got "true"'),
    ("qwen3", {"layer_types": "sliding_attention"}, "layer_types must be a list of strings or null"),
    ("qwen3", {"use_sliding_window": 1}, "use_sliding_window must be true or false, got 1"),
    ("mistral", {"sliding_window": "6"}, 'sliding_window must be an integer or null, got "6"'),
    ("qwen2", {"max_window_layers": None}, "max_window_layers must be an integer, got null"),
    ("llama", {"rope_parameters": {"rope_type": "llama3", "factor": "8"}},
     'rope_parameters.factor must be a number, got "8"'),
    ("llama", {"rope_scaling": []}, "rope_scaling must be an object or null, got []"),
    ("gpt2", {"scale_attn_weights": "yes"}, 'scale_attn_weights must be true or false, got "yes"'),
    ("gpt2", {"n_inner": 64.0}, "n_inner must be an integer or null, got 64.0"),
    ("llama", {"architectures": "LlamaForCausalLM"}, "architectures must be a list of strings or null"),
])
def test_a_value_of_the_wrong_kind_is_one_line_naming_the_key(tmp_path, folders, family, changes, message):
    path = copy_folder(folders[family], tmp_path / "folder", **changes)
    with pytest.raises(ValueError, match="config.json: ") as error:
        GPT.from_pretrained(path)
    assert_one_line(error, message)


class ReadKeys(dict):
    """A config.json's dict that notes each key read from it (and from a dict merged with it)."""

    def __init__(self, *args, read=None):
        super().__init__(*args)
        self.read = set() if read is None else read

    def __getitem__(self, key):
        self.read.add(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self.read.add(key)
        return super().get(key, default)

    def __ror__(self, other):  # (LLAMA_DEFAULTS[family] | hf)
        return ReadKeys({**other, **self}, read=self.read)


def test_every_key_read_has_a_kind_and_each_is_checked(tmp_path, folders):
    """Every key the readers read is in their table of kinds (so none is read unchecked), and each
    key of the tables, holding a value of no kind's or null, is one line naming it: null only where
    transformers' own default is null (NULLABLE, then absent)."""
    for family, folder in folders.items():
        hf = ReadKeys(json.loads((folder / "config.json").read_text()))
        gpt2_fields(hf) if family == "gpt2" else llama_fields(hf, family)
        table = GPT2_KEYS if family == "gpt2" else LLAMA_KEYS
        assert hf.read <= table.keys(), hf.read - table.keys()
    checks = [("gpt2", key, "") for key in GPT2_KEYS] + [("llama", key, "") for key in LLAMA_KEYS]
    checks += [("llama", key, "rope_parameters.") for key in ROPE_KEYS]
    for family, key, within in checks:
        for value in ([1], None):
            path = tmp_path / f"{family}-{within}{key}-{value}"
            change = {key: value} if not within else {"rope_parameters": {"rope_type": "default", key: value}}
            copy_folder(folders[family], path, **change)
            if value is None and (key in NULLABLE or within and key in ("rope_type", "type")):
                continue  # (null: absent, or an unsupported RoPE's own line)
            with pytest.raises(ValueError, match=re.escape(f"config.json: {within}{key} must be ")) as e:
                folder_config(path)
            assert_one_line(e)
    for key in NULLABLE & LLAMA_KEYS.keys():  # null: absent, or as transformers reads it (head_dim's:
        family = "qwen3" if key == "layer_types" else "llama"  # hidden_size / heads, not these weights')
        try:
            folder_config(copy_folder(folders[family], tmp_path / f"null-{key}", **{key: None}))
        except ValueError as e:
            assert key in ("head_dim", "num_key_value_heads") and "weights do not match" in str(e), e


def test_a_config_without_model_type_is_read_by_its_architectures(tmp_path, folders):
    """As transformers' AutoConfig would from its architectures; else (another family, none) in one
    line that says what kvgpt reads."""
    path = folders["qwen3"]
    expected = GPT.from_pretrained(path).config
    assert GPT.from_pretrained(copy_folder(path, tmp_path / "a", model_type=DROP)).config == expected
    old_gpt2 = copy_folder(folders["gpt2"], tmp_path / "gpt2", model_type=DROP, architectures=DROP)
    assert folder_config(old_gpt2)[0] == "gpt2"
    for architectures, named in ([["MixtralForCausalLM"], "architectures ['MixtralForCausalLM'] name none"],
                                 [DROP, "no architectures nor GPT-2's keys"],
                                 [["LlamaForCausalLM", "Qwen3ForCausalLM"], "name more than one"]):
        folder = copy_folder(path, tmp_path / f"{named[:5]}", model_type=DROP, architectures=architectures)
        with pytest.raises(ValueError, match="config.json has no model_type") as error:
            GPT.from_pretrained(folder)
        assert_one_line(error, named, "Qwen3ForCausalLM")


def test_a_hostile_folder_is_one_error_line_from_generate(tmp_path, folders):
    """`python generate.py ckpt=<folder>` (run in this process): a NaN in its weights, a config.json
    of a million layers over three: `error: <one line>`, exit 1, at once."""
    nan = copy_folder(folders["llama"], tmp_path / "nan")
    change_weights(nan, lambda w: w["model.norm.weight"].__setitem__(7, math.nan))
    deep = copy_folder(folders["qwen3"], tmp_path / "deep", num_hidden_layers=10**6)
    nan_run, deep_run = (run_in_process("generate.py", f"ckpt={path}", "max_new_tokens=4")
                         for path in (nan, deep))
    assert_one_line_error(nan_run, f"{nan / 'model.safetensors'}: its weights hold NaN or inf "
                                   f"(model.norm.weight)")
    assert_one_line_error(deep_run, "num_hidden_layers=1000000, but the weights hold 3 layers")
