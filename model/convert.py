"""Conversions between checkpoints.

Convert an MHA checkpoint to GQA or MQA by mean-pooling key/value heads:

    python -m cli.convert outputs/<run> --n-kv-head 2 --out gqa.pt
    python train.py init_from=gqa.pt ...      # then uptrain briefly

Ainslie et al. 2023, "GQA: Training Generalized Multi-Query Transformer Models from Multi-Head
Checkpoints", §2.1: each new key (value) head is the mean of the original heads in its group.

And `llama_weights`: a GPT with RoPE, RMSNorm, SwiGLU and no biases (the CPU main job's
architecture) as a Hugging Face Llama's config and state dict, so that transformers can run the
very same weights (the decode benchmark and the parity tests compare against it); with a sliding
window, `mistral_weights` (a Mistral); with multi-head latent attention, `deepseek_v3_weights`;
the GPU recipe's (LayerNorm, GELU, biases, RoPE), `neox_weights` (a GPT-NeoX).
"""

import dataclasses
from pathlib import Path

import torch

from model import checkpoint
from model.checkpoint import Checkpoint
from model.config import ROPE_SCALING_KEYS, GPTConfig, check_integer
from model.pretrained import LLAMA_FUSED, LLAMA_NAMES, LLAMA_OUTER


def mean_pool_kv(state: dict, config: GPTConfig, n_kv_head: int) -> tuple[dict, GPTConfig]:
    """Weights and config of the model with n_kv_head key/value heads, each the mean of a group
    of consecutive heads (query head h keeps reading the group that holds its old K/V head)."""
    if config.mla_latent_dim is not None:
        raise ValueError("this checkpoint uses multi-head latent attention (mla_latent_dim): its keys "
                         "and values come from a latent, there are no K/V heads to mean-pool")
    check_integer(n_kv_head, "n_kv_head", 1)
    if config.n_kv_head % n_kv_head:  # (so it divides n_head too: the new config is valid)
        raise ValueError(f"n_kv_head={n_kv_head} must divide the checkpoint's {config.n_kv_head} K/V heads")
    new_config = dataclasses.replace(config, n_kv_head=n_kv_head)
    q_dim, hd, old = config.n_head * config.head_dim, config.head_dim, config.n_kv_head
    group = old // n_kv_head

    def pool(t):  # (old * hd, ...) -> (n_kv_head * hd, ...)
        grouped = t.reshape(n_kv_head, group, hd, *t.shape[1:])    # (n_kv_head, group, hd, ...)
        return grouped.mean(dim=1).reshape(n_kv_head * hd, *t.shape[1:])  # (n_kv_head * hd, ...)

    new_state = dict(state)
    for name, tensor in state.items():
        # Layers that reuse an earlier layer's K/V (kv_share > 1) project queries only.
        if (name.endswith("attn.qkv.weight") or name.endswith("attn.qkv.bias")) and len(tensor) > q_dim:
            q, k, v = tensor.split([q_dim, old * hd, old * hd], dim=0)  # (q_dim, ...), (old * hd, ...) x 2
            new_state[name] = torch.cat([q, pool(k), pool(v)], dim=0)
    return new_state, new_config


def llama_weights(model) -> tuple[dict, dict]:
    """(LlamaConfig keyword arguments, LlamaForCausalLM state dict) holding `model`'s weights.
    Our RoPE rotates the halves (x[:hd/2], x[hd/2:]) as Llama's rotate_half does, so the query
    and key rows need no permutation; the fused projections are split."""
    return llama_layout(model, "Llama", {"mla_latent_dim": None, "attn_window": None})


def mistral_weights(model) -> tuple[dict, dict]:
    """(MistralConfig keyword arguments, MistralForCausalLM state dict): a Llama with a sliding
    window. Mistral's `sliding_window` W lets query i see keys i - W < j <= i: our attn_window."""
    if model.config.attn_window is None:
        raise ValueError("a Mistral needs model.attn_window (its sliding_window), this model has null")
    config, state = llama_layout(model, "Mistral", {"mla_latent_dim": None})
    return config | {"sliding_window": model.config.attn_window}, state


def deepseek_v3_weights(model) -> tuple[dict, dict]:
    """(DeepseekV3Config keyword arguments, DeepseekV3ForCausalLM state dict): our MLA is
    DeepseekV3's attention without the query's low-rank path (q_lora_rank=None) in every layer
    dense (no experts). Our `q` is its q_proj, `kv_down` its kv_a_proj_with_mqa ([c, k_r]),
    `kv_norm` its kv_a_layernorm (fixed eps 1e-6: the model's norm_eps must be 1e-6), and
    `kv_up` (every head's key rows, then every head's value rows) its kv_b_proj (per head, key
    rows then value rows). Its RoPE is rotate_half's with rope_interleave=False."""
    c = model.config
    if c.mla_latent_dim is None:
        raise ValueError("a DeepseekV3 needs model.mla_latent_dim (multi-head latent attention), this "
                         "model has null")
    if not c.mla_kv_norm or c.mla_rope_pairs is not None:  # (a retrofit's latent and RoPE key)
        raise ValueError("a DeepseekV3 needs model.mla_kv_norm=true and model.mla_rope_pairs=null (its "
                         "normalised latent and its own RoPE frequencies), this model has "
                         f"{c.mla_kv_norm} and {c.mla_rope_pairs!r:.80}")
    config, state = llama_layout(model, "DeepseekV3", {"attn_window": None, "norm_eps": 1e-6})
    hd, L = c.head_dim, c.mla_latent_dim
    config |= {"q_lora_rank": None, "kv_lora_rank": L, "qk_rope_head_dim": c.mla_rope_dim,
               "qk_nope_head_dim": hd, "v_head_dim": hd, "first_k_dense_replace": c.n_layer,
               "n_routed_experts": 1, "n_shared_experts": 1, "num_experts_per_tok": 1,
               "rope_interleave": False, "head_dim": c.mla_rope_dim}  # head_dim: the width RoPE rotates
    for i, block in enumerate(model.blocks):
        attn, layer = block.attn, f"model.layers.{i}.self_attn."
        w_k, w_v = attn.kv_up.detach().view(2, c.n_head, hd, L)                # (n_head, hd, L) each
        state |= {layer + "q_proj.weight": attn.q.weight.detach().clone(),
                  layer + "kv_a_proj_with_mqa.weight": attn.kv_down.weight.detach().clone(),
                  layer + "kv_a_layernorm.weight": attn.kv_norm.weight.detach().clone(),
                  layer + "kv_b_proj.weight": torch.cat([w_k, w_v], dim=1).reshape(-1, L)}  # (n_head*2hd, L)
    return config, state


def neox_weights(model) -> tuple[dict, dict]:
    """(GPTNeoXConfig keyword arguments, GPTNeoXForCausalLM state dict) holding `model`'s weights:
    the GPU recipe's architecture (nanoGPT's LayerNorm, GELU and biases, with RoPE). GPT-NeoX runs
    its blocks in sequence (use_parallel_residual=False), rotates the halves as our RoPE does, and
    fuses q, k and v per head ([q_h, k_h, v_h] for each head h), where ours are [q, k, v] whole."""
    c = model.config
    required = {"pos_emb": "rope", "norm": "layernorm", "qk_norm": False, "kv_share": 1,
                "n_kv_head": c.n_head, "attn_window": None, "mla_latent_dim": None, "attn_sink_logit": False,
                "head_dim": c.n_embd // c.n_head, "mlp_hidden": None, "qkv_bias": None, "rope_scaling": None}
    for field, value in required.items():
        if getattr(c, field) != value:
            raise ValueError(f"a GPT-NeoX needs model.{field}={'null' if value is None else value}, "
                             f"this model has {getattr(c, field)!r}")
    if c.mlp == "swiglu":
        raise ValueError("a GPT-NeoX needs model.mlp=gelu or gelu_exact, this model has 'swiglu'")
    config = {"vocab_size": c.vocab_size, "hidden_size": c.n_embd, "num_hidden_layers": c.n_layer,
              "num_attention_heads": c.n_head, "intermediate_size": 4 * c.n_embd,
              "hidden_act": "gelu_new" if c.mlp == "gelu" else "gelu", "rotary_pct": 1.0,
              "rotary_emb_base": c.rope_base, "max_position_embeddings": c.block_size,
              "layer_norm_eps": c.norm_eps, "use_parallel_residual": False,
              "tie_word_embeddings": c.tie_embeddings,
              "attention_dropout": 0.0, "hidden_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 0}
    ours = {k: v.detach().clone() for k, v in model.state_dict().items()}
    bias = lambda name, n: ours.get(name, torch.zeros(n))  # noqa: E731  (bias=false: zeros)
    C, hd = c.n_embd, c.head_dim
    state = {"gpt_neox.embed_in.weight": ours["wte.weight"], "lm_head.weight": ours["lm_head.weight"],
             "gpt_neox.final_layer_norm.weight": ours["norm_f.weight"],
             "gpt_neox.final_layer_norm.bias": bias("norm_f.bias", C)}
    for i in range(c.n_layer):
        block, layer = f"blocks.{i}.", f"gpt_neox.layers.{i}."
        qkv = ours[block + "attn.qkv.weight"].view(3, c.n_head, hd, C)            # (q/k/v, head, hd, C)
        qkv_bias = bias(block + "attn.qkv.bias", 3 * C).view(3, c.n_head, hd)
        state |= {layer + "attention.query_key_value.weight": qkv.transpose(0, 1).reshape(3 * C, C),
                  layer + "attention.query_key_value.bias": qkv_bias.transpose(0, 1).reshape(3 * C)}
        for ours_name, theirs, n in (("norm_1", "input_layernorm", C),
                                     ("norm_2", "post_attention_layernorm", C),
                                     ("attn.proj", "attention.dense", C),
                                     ("mlp.fc", "mlp.dense_h_to_4h", 4 * C),
                                     ("mlp.proj", "mlp.dense_4h_to_h", C)):
            state |= {layer + theirs + ".weight": ours[block + ours_name + ".weight"],
                      layer + theirs + ".bias": bias(block + ours_name + ".bias", n)}
    return config, state


def llama_layout(model, family: str, needs: dict) -> tuple[dict, dict]:
    """What Llama, Mistral and DeepseekV3 share: the config of a pre-norm RMSNorm/SwiGLU/RoPE
    decoder and the state of its embeddings, norms, MLPs and head, and for a model with K/V heads
    (not MLA) its attention too, named as model.pretrained reads them. `needs`: more fields `family`
    requires of the model."""
    c = model.config
    required = {"pos_emb": "rope", "norm": "rmsnorm", "mlp": "swiglu", "bias": False, "qk_norm": False,
                "kv_share": 1, "window_pattern": None, "attn_sinks": 0, "attn_sink_logit": False,
                "qkv_bias": None} | needs
    for field, value in required.items():
        if getattr(c, field) != value:
            raise ValueError(f"a {family} needs model.{field}={'null' if value is None else value}, "
                             f"this model has {getattr(c, field)!r}")
    config = {"vocab_size": c.vocab_size, "hidden_size": c.n_embd, "intermediate_size": c.mlp_width,
              "num_hidden_layers": c.n_layer, "num_attention_heads": c.n_head,
              "num_key_value_heads": c.n_kv_head, "head_dim": c.head_dim,
              "max_position_embeddings": c.block_size, "rms_norm_eps": c.norm_eps, "rope_theta": c.rope_base,
              "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
              "tie_word_embeddings": c.tie_embeddings, "bos_token_id": 0, "eos_token_id": 0,
              "pad_token_id": 0}
    if c.rope_scaling is not None:
        config["rope_scaling"] = {"rope_type": "llama3", **dict(zip(ROPE_SCALING_KEYS, c.rope_scaling))}
    ours = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state = {theirs: ours[name] for name, theirs in LLAMA_OUTER.items()}
    kv_dim = c.n_kv_head * c.head_dim
    rows = {"attn.qkv": [c.n_head * c.head_dim, kv_dim, kv_dim], "mlp.fc": [c.mlp_width] * 2}
    for i in range(c.n_layer):
        block, layer = f"blocks.{i}.", f"model.layers.{i}."
        state |= {layer + theirs: ours[block + name] for name, theirs in LLAMA_NAMES.items()
                  if block + name in ours}
        for name, parts in LLAMA_FUSED.items():  # (MLA has no attn.qkv: deepseek_v3_weights adds its own)
            if block + name + ".weight" in ours:
                fused = ours[block + name + ".weight"].split(rows[name])           # (their rows, n_embd) each
                state |= {f"{layer}{part}.weight": tensor for part, tensor in zip(parts, fused)}
    return config, state


def convert_checkpoint(src, n_kv_head: int, out) -> tuple[GPTConfig, GPTConfig]:
    """Read our checkpoint `src` (a run dir's best.pt, or a file), write the converted one to
    `out` (atomically, as checkpoint.save); returns the old and new model configs."""
    out = Path(out).expanduser()
    ckpt = checkpoint.load(src, prefer="best.pt")
    weights, new_config = mean_pool_kv(ckpt.model, ckpt.model_config, n_kv_head)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise type(e)(f"cannot create {out.parent}: {e.strerror or e}") from e
    checkpoint.save(out, Checkpoint(
        model=weights, model_config=new_config, data_meta=ckpt.data_meta, config=ckpt.config,
        converted_from={"path": str(src), "n_kv_head": ckpt.model_config.n_kv_head}))
    return ckpt.model_config, new_config


if __name__ == "__main__":  # the command it was before the command lines moved to cli/
    raise SystemExit("error: model.convert is a library module now; the command is python -m cli.convert")
