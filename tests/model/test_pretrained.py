"""Hugging Face folders of the Llama family (model/pretrained.py): each family's random model as
transformers writes it loads exactly (logits, greedy tokens with our cache and without), its
config fields read as transformers reads them, and what we do not build refused in one line."""

import json

import pytest
import torch

from model import GPT, GPTConfig, generate
from model.pretrained import llama_fields
from tests.helpers import HF_FAMILIES, hf_folder

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
    ("llama", {"rope_scaling": "llama3"},
     r"is not a Llama config \(TypeError: rope_scaling is a str, not a dict"),
    ("qwen3", {"hidden_size": DROP}, r"config.json is not a Qwen3 config \(KeyError: 'hidden_size'"),
    ("qwen3", {"hidden_size": None}, r"config.json: GPTConfig.n_embd must be an integer >= 1, got None"),
    ("llama", {"num_attention_heads": 5}, r"config.json: GPTConfig.n_kv_head=2 must divide n_head=5"),
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


def test_a_weight_missing_or_left_over_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    hf_folder(tmp_path, "llama")
    weights = load_file(tmp_path / "model.safetensors")
    weights["model.layers.0.self_attn.extra.weight"] = weights.pop("model.layers.0.input_layernorm.weight")
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing \['blocks.0.norm_1.weight'\], unexpected "
                                         r"\['model.layers.0.self_attn.extra.weight'\]"):
        GPT.from_pretrained(tmp_path)
