"""Hugging Face parity: our GPT-2 loads transformers' weights and matches its logits and greedy
tokens; finetuning from a Hugging Face directory."""

import pytest
import torch
import torch.nn as nn

from model import GPT, checkpoint, generate
from model.attention import CausalSelfAttention
from model.rope import rope_at
from tests.helpers import compose, hf_gpt2, run_in_process, tiny_config, tiny_model, train_checked

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
    ("config.json:{not json", r"config.json is not a Hugging Face config \(JSONDecodeError"),
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
    multi-head latent attention its DeepseekV3 (model.convert's mappings), with QK-norm its Qwen3
    (qwen3_weights, below)."""
    from model import convert

    c = model.config
    family = "Qwen3" if c.qk_norm else "DeepseekV3" if c.mla_latent_dim is not None else \
        "Llama" if c.attn_window is None else "Mistral"
    config, state = {"Llama": convert.llama_weights, "Mistral": convert.mistral_weights,
                     "DeepseekV3": convert.deepseek_v3_weights, "Qwen3": qwen3_weights}[family](model)
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


# Per-layer windows (window_pattern) and gpt-oss's learned sinks (attn_sink_logit), each against the
# transformers model that has them: Qwen3's layer_types, GptOss's attention.

def qwen3_weights(model) -> tuple[dict, dict]:
    """(Qwen3Config keyword arguments, Qwen3ForCausalLM state dict): model.convert's Llama layout,
    which holds each head's query and key RMSNorm (Qwen3's q_norm and k_norm, like ours before RoPE),
    each layer's window (config.layer_window) as its layer_types, and no end-of-text token (its generate
    then never stops early nor bans token 0)."""
    from model.convert import llama_layout

    c = model.config
    config, state = llama_layout(model, "Qwen3", {"qk_norm": True, "mla_latent_dim": None,
                                                  "window_pattern": c.window_pattern})
    config |= {"layer_types": ["full_attention" if c.layer_window(i) is None else "sliding_attention"
                               for i in range(c.n_layer)],
               "use_sliding_window": c.attn_window is not None, "sliding_window": c.attn_window,
               "eos_token_id": None}
    return config, state  # (the layout names q_norm and k_norm too: model.pretrained.LLAMA_NAMES)


@pytest.mark.parametrize("kv_cache", [True, False], ids=["cache", "no_cache"])
@pytest.mark.parametrize("window_pattern, layer_types", [
    ("SL", ["sliding_attention", "full_attention"] * 2),
    ("SSSL", ["sliding_attention"] * 3 + ["full_attention"]),
])
def test_per_layer_windows_with_qk_norm_match_transformers_qwen3(window_pattern, layer_types, kv_cache):
    """transformers' Qwen3 (its layer_types, per-head q_norm/k_norm): logits within 1e-5 over 20
    tokens with a window of 4, and its greedy tokens up to block_size (24)."""
    ours = tiny_model(**LLAMA_LIKE, n_layer=4, n_kv_head=2, qk_norm=True, attn_window=4,
                      window_pattern=window_pattern)
    for block in ours.blocks:  # norms that are not all ones, so a norm left out or swapped shows
        nn.init.normal_(block.attn.q_norm.weight, 1.0, 0.3)
        nn.init.normal_(block.attn.k_norm.weight, 1.0, 0.3)
    hf = hf_model(ours)
    assert hf.config.layer_types == layer_types and hf.config.sliding_window == 4
    idx = torch.randint(0, 65, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), hf(idx).logits, atol=1e-5, rtol=0)
    expected = hf.generate(idx[:, :5], max_new_tokens=19, do_sample=False)
    assert torch.equal(generate(ours, idx[:, :5], 19, temperature=0, kv_cache=kv_cache), expected)


def hf_gpt_oss_attention(attn, config, window):
    """transformers' GptOssAttention (eager, the sinks in its softmax) holding our attention layer's
    weights and sinks, sliding over `window` positions (sliding_attention) or, with None, not
    (full_attention); and the GptOssConfig its rotary embedding and masks are built from."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention

    hf_config = transformers.GptOssConfig(
        hidden_size=config.n_embd, num_attention_heads=config.n_head, num_key_value_heads=config.n_kv_head,
        head_dim=config.head_dim, num_hidden_layers=1, attention_bias=config.bias, sliding_window=window,
        layer_types=["full_attention" if window is None else "sliding_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, attn_implementation="eager")
    hf = GptOssAttention(hf_config, layer_idx=0).eval()
    kv_dim = config.n_kv_head * config.head_dim
    q, k, v = attn.qkv.weight.detach().split([config.n_embd, kv_dim, kv_dim])
    q_bias, k_bias, v_bias = attn.qkv.bias.detach().split([config.n_embd, kv_dim, kv_dim])
    hf.load_state_dict({"q_proj.weight": q, "k_proj.weight": k, "v_proj.weight": v, "q_proj.bias": q_bias,
                        "k_proj.bias": k_bias, "v_proj.bias": v_bias, "o_proj.weight": attn.proj.weight,
                        "o_proj.bias": attn.proj.bias, "sinks": attn.sink_logit})
    return hf, hf_config


@pytest.mark.parametrize("backend", ["sdpa", "naive"])
@pytest.mark.parametrize("layer_idx, window", [(0, 4), (1, None)], ids=["sliding", "full"])
def test_learned_sinks_match_transformers_gpt_oss_attention(layer_idx, window, backend):
    """transformers' GptOssAttention (eager): a learned logit per head in the softmax's denominator,
    in a sliding layer (window 4) and a full one, outputs within 1e-5 over 12 positions."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    config = tiny_config(pos_emb="rope", n_kv_head=2, attn_window=4, window_pattern="SL",
                         attn_sink_logit=True, attn_backend=backend)
    torch.manual_seed(0)
    attn = CausalSelfAttention(config, layer_idx).eval()
    assert config.layer_window(layer_idx) == window
    assert torch.equal(attn.sink_logit, torch.zeros(config.n_head))
    with torch.no_grad():
        attn.sink_logit.normal_(0.0, 2.0)  # from nearly nothing to most of the weight, per head
        attn.qkv.bias.normal_(0.0, 0.1)  # GPT init zeroes the biases, which would then go unchecked
    hf, hf_config = hf_gpt_oss_attention(attn, config, window)
    x, positions = torch.randn(2, 12, config.n_embd), torch.arange(12)
    mask = (create_causal_mask if window is None else create_sliding_window_causal_mask)(
        config=hf_config, inputs_embeds=x, attention_mask=None, cache=None, position_ids=positions[None])
    with torch.no_grad():
        expected, _ = hf(x, GptOssRotaryEmbedding(hf_config)(x, positions[None]), mask)
        out, _ = attn(x, rope=rope_at(positions, config.head_dim))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("bias", [True, False])
def test_the_gpu_recipes_architecture_matches_transformers_gpt_neox(bias):
    """LayerNorm, GELU (tanh), RoPE over the whole head, biases or none: GPT-NeoX's logits, and its
    greedy tokens with our cache."""
    from model import convert

    model = tiny_model(pos_emb="rope", bias=bias, n_embd=32, vocab_size=65)
    with torch.no_grad():
        for p in model.parameters():  # biases and norms away from their initial zeros and ones
            p.add_(torch.randn_like(p) * 0.02)
    config, state = convert.neox_weights(model)
    hf = transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(**config)).eval()
    hf.load_state_dict(state)
    idx = torch.randint(0, 65, (2, 24))
    with torch.no_grad():
        torch.testing.assert_close(model(idx), hf(idx).logits, atol=1e-5, rtol=0)
    ours = generate(model, idx[:, :5], 12, temperature=0)
    theirs = hf.generate(idx[:, :5], max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert torch.equal(ours, theirs)
