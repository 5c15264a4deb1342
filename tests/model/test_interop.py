"""Hugging Face parity: our GPT-2 loads transformers' weights and matches its logits and greedy
tokens; finetuning from a Hugging Face directory."""

import pytest
import torch

from model import GPT, checkpoint, generate
from tests.helpers import compose, hf_gpt2, run_in_process, tiny_model, train_checked

transformers = pytest.importorskip("transformers")


def test_logits_match_transformers(tmp_path):
    hf = hf_gpt2(tmp_path)
    ours = GPT.from_pretrained(tmp_path).eval()
    idx = torch.randint(0, 97, (3, 40))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, atol=1e-5, rtol=0)
    assert ours.config.n_kv_head == 4 and ours.config.block_size == 48


@pytest.mark.parametrize("kv_cache", [True, False])
def test_greedy_generation_matches_transformers(tmp_path, kv_cache):
    hf = hf_gpt2(tmp_path)
    ours = GPT.from_pretrained(tmp_path).eval()
    idx = torch.randint(0, 97, (2, 7))
    expected = hf.generate(idx, max_new_tokens=30, min_new_tokens=30, do_sample=False, pad_token_id=0)
    assert torch.equal(generate(ours, idx, 30, temperature=0, kv_cache=kv_cache), expected)


@pytest.mark.parametrize("field,value", [("activation_function", "relu"), ("n_inner", 64),
                                         ("scale_attn_by_inverse_layer_idx", True)])
def test_unsupported_gpt2_config_names_the_field(tmp_path, field, value):
    hf_gpt2(tmp_path, **{field: value})
    with pytest.raises(ValueError, match=rf"unsupported GPT-2 config: {field}="):
        GPT.from_pretrained(tmp_path)


@pytest.mark.slow
def test_finetune_from_hugging_face_then_sample(tmp_path):
    hf_dir = tmp_path / "hf"
    hf_gpt2(hf_dir, vocab_size=50257, n_embd=16, n_layer=1, n_head=2, n_positions=64)
    run = tmp_path / "run"
    train_checked(compose("experiment=shakespeare_bpe", f"init_from={hf_dir}", "train.max_iters=4",
                  "train.eval_interval=2", "train.eval_iters=1", "train.batch_size=2",
                  "train.lr=3e-5", "train.min_lr=3e-5", "train.warmup_iters=0", "train.sample_tokens=0",
                  "train.full_val=false"), run)  # the whole val split through a 50257-wide head: 20 s
    ckpt = checkpoint.load(run)
    assert ckpt.model_config.n_embd == 16 and ckpt.model_config.block_size == 64
    assert ckpt.data_meta["tokenizer"] == "bpe"
    result = run_in_process("generate.py", f"ckpt={run}", "prompt=ROMEO:", "max_new_tokens=8")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ROMEO:")


def test_init_from_a_hugging_face_directory(tmp_path):
    hf = hf_gpt2(tmp_path)
    source = checkpoint.init_from(tmp_path)
    assert source.data_meta["tokenizer"] == "bpe"
    model = GPT(source.model_config).eval()
    checkpoint.load_weights(model, source.model)
    idx = torch.randint(0, 97, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), hf(idx).logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("damage, message", [
    ("config.json:{not json", r"config.json is not a GPT-2 config \(JSONDecodeError"),
    ('config.json:{"n_layer": 2}', r"config.json is not a GPT-2 config \(KeyError"),
    ("model.safetensors:garbage", r"model.safetensors cannot be read"),
    ('config.json:{"vocab_size": 97, "n_positions": 48, "n_embd": 64, "n_layer": 2, "n_head": 4}',
     r"weights do not match its config.json"),
])
def test_a_damaged_hugging_face_directory_is_a_value_error_naming_the_file(tmp_path, damage, message):
    hf_gpt2(tmp_path)
    name, content = damage.split(":", 1)
    (tmp_path / name).write_text(content)
    with pytest.raises(ValueError, match=message):
        GPT.from_pretrained(tmp_path)


def hf_model(model):
    """transformers' Llama holding `model`'s weights; with a sliding window its Mistral, with
    multi-head latent attention its DeepseekV3 (model.convert's mappings)."""
    from model import convert

    c = model.config
    family = "Llama" if c.attn_window is None and c.mla_latent_dim is None else \
        "Mistral" if c.mla_latent_dim is None else "DeepseekV3"
    config, state = getattr(convert, {"Llama": "llama_weights", "Mistral": "mistral_weights",
                                      "DeepseekV3": "deepseek_v3_weights"}[family])(model)
    hf = getattr(transformers, f"{family}ForCausalLM")(getattr(transformers, f"{family}Config")(**config))
    hf.eval().load_state_dict(state)
    return hf


LLAMA_LIKE = {"pos_emb": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False, "n_embd": 32,
              "vocab_size": 65}


@pytest.mark.parametrize("kv_cache", [True, False], ids=["cache", "no_cache"])
@pytest.mark.parametrize("variant", [{"n_kv_head": 4}, {"n_kv_head": 2}, {"n_kv_head": 1},
                                     {"n_kv_head": 2, "attn_window": 5},
                                     {"mla_latent_dim": 12, "mla_rope_dim": 4, "norm_eps": 1e-6}],
                         ids=["mha", "gqa", "mqa", "window", "mla"])
def test_every_variant_matches_transformers_llama_mistral_or_deepseek_v3(variant, kv_cache):
    """Llama's num_key_value_heads (MHA, GQA, MQA), Mistral's sliding_window, DeepseekV3's MLA:
    logits within 1e-4 in float32, and greedy tokens identical to transformers' generate (the
    window's 3x past block_size, 24). With our cache, MLA runs its absorbed form."""
    ours = tiny_model(**LLAMA_LIKE, **variant)
    hf = hf_model(ours)
    idx = torch.randint(0, 65, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, atol=1e-4, rtol=1e-4)
    new = 72 if "attn_window" in variant else 15
    expected = hf.generate(idx[:1, :5], max_new_tokens=new, min_new_tokens=new, do_sample=False)
    assert torch.equal(generate(ours, idx[:1, :5], new, temperature=0, kv_cache=kv_cache), expected)


def test_llama_export_names_what_a_llama_cannot_hold():
    from model.convert import deepseek_v3_weights, llama_weights, mistral_weights

    with pytest.raises(ValueError, match="model.pos_emb=rope"):
        llama_weights(tiny_model())
    llama_like = {"pos_emb": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False}
    with pytest.raises(ValueError, match="model.mla_latent_dim=null"):
        llama_weights(tiny_model(mla_latent_dim=8, mla_rope_dim=2, **llama_like))
    with pytest.raises(ValueError, match="model.kv_share=1"):
        llama_weights(tiny_model(kv_share=2, **llama_like))
    with pytest.raises(ValueError, match="a Llama needs model.attn_window=null"):
        llama_weights(tiny_model(attn_window=4, **llama_like))
    with pytest.raises(ValueError, match="a Mistral needs model.attn_window"):
        mistral_weights(tiny_model(**llama_like))
    with pytest.raises(ValueError, match="a DeepseekV3 needs model.mla_latent_dim"):
        deepseek_v3_weights(tiny_model(**llama_like))
    with pytest.raises(ValueError, match="a DeepseekV3 needs model.norm_eps=1e-06"):
        deepseek_v3_weights(tiny_model(mla_latent_dim=8, mla_rope_dim=2, **llama_like))
