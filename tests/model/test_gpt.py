"""model/gpt.py and model/kv_cache.py: MHA/GQA/MQA as one class, MLA and cross-layer K/V sharing,
causality, the cache (prefill + decode = full forward, exact bytes, its length), left padding,
config errors, a tiny overfit."""

import math
import re

import pytest
import torch

from model import GPT
from model.generation import generate
from tests.helpers import ATTENTION, ROOT, tiny_config, tiny_model


def test_gqa_with_n_kv_head_equal_n_head_is_mha():
    mha = GPT(tiny_config())  # n_kv_head defaults to n_head
    gqa = GPT(tiny_config(n_kv_head=4))
    assert gqa.num_params() == mha.num_params()
    gqa.load_state_dict(mha.state_dict())
    idx = torch.randint(0, 37, (2, 10))
    assert torch.equal(mha(idx), gqa(idx))


def test_fewer_kv_heads_mean_fewer_parameters():
    counts = [GPT(tiny_config(n_kv_head=n)).num_params() for n in (4, 2, 1)]
    assert counts[0] > counts[1] > counts[2]
    # Each K/V head less saves a (n_embd x hd) weight and an hd bias in K and in V, per layer.
    assert counts[0] - counts[1] == 2 * 2 * 2 * (16 * 4 + 4)


@pytest.mark.parametrize("attention", ["gqa", "mla", "mqa_cla2"])
@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize("backend", ["sdpa", "naive"])
def test_causality(pos_emb, backend, attention):
    model = GPT(tiny_config(pos_emb=pos_emb, attn_backend=backend, **ATTENTION[attention])).eval()
    idx = torch.randint(0, 37, (1, 12))
    changed = idx.clone()
    changed[0, 6] = (idx[0, 6] + 1) % 37
    a, b = model(idx), model(changed)
    assert torch.equal(a[:, :6], b[:, :6])
    assert not torch.allclose(a[:, 6:], b[:, 6:])


@pytest.mark.parametrize("attention", ATTENTION.values(), ids=ATTENTION.keys())
@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize("backend", ["sdpa", "naive"])
def test_cache_prefill_then_decode_equals_full_forward(attention, pos_emb, backend):
    """For MLA: the absorbed form (with the cache) equals the plain form to 1e-5 in fp32."""
    qk_norm = "mla_latent_dim" not in attention  # a per-head key norm cannot be absorbed
    config = tiny_config(pos_emb=pos_emb, attn_backend=backend, qk_norm=qk_norm, **attention)
    model = GPT(config).eval()
    idx = torch.randint(0, 37, (3, 20))
    full = model(idx)
    cache = model.new_kv_cache(batch_size=3)
    steps = [model(idx[:, :8], kv_cache=cache)]
    steps += [model(idx[:, t : t + 1], kv_cache=cache) for t in range(8, 20)]
    assert cache.length == 20
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_left_padded_rows_equal_unpadded(pos_emb):
    model = GPT(tiny_config(pos_emb=pos_emb, n_kv_head=2)).eval()
    short, long = torch.randint(0, 37, (1, 5)), torch.randint(0, 37, (1, 9))
    batch = torch.cat([torch.cat([torch.zeros(1, 4, dtype=torch.long), short], 1), long])
    pad = torch.tensor([4, 0])
    padded = model(batch, starts=pad)
    torch.testing.assert_close(padded[0, 4:], model(short)[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(padded[1], model(long)[0], atol=1e-5, rtol=0)
    assert not padded.isnan().any()


@pytest.mark.parametrize("attention", ATTENTION.values(), ids=ATTENTION.keys())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_bytes_follow_the_formula(attention, dtype):
    """Per token: (layers holding K/V) x (2 x n_kv_head x head dim, or MLA's latent + RoPE width)
    x dtype bytes, where ceil(n_layer / kv_share) layers hold K/V."""
    config = tiny_config(**attention)
    cache = GPT(config).new_kv_cache(batch_size=3, max_len=10, dtype=dtype)
    layers = math.ceil(config.n_layer / config.kv_share)
    if config.mla_latent_dim is None:
        per_layer = 2 * config.n_kv_head * (config.n_embd // config.n_head)
    else:
        per_layer = config.mla_latent_dim + config.mla_rope_dim
    assert cache.bytes_per_token == layers * per_layer * dtype.itemsize
    assert cache.nbytes == layers * per_layer * dtype.itemsize * 10 * 3
    assert str(layers) in config.kv_cache_formula()


@pytest.mark.parametrize("attention", ["mqa_cla2", "gqa_cla2_3_layers", "mla_cla2_3_layers"])
def test_shared_layers_attend_over_their_groups_first_layers_keys_and_values(attention):
    """With kv_share=2, layers 1 (and 3, ...) have no K/V projection and use exactly the tensors
    layer 0 (2, ...) made, with the cache too."""
    model = GPT(tiny_config(**ATTENTION[attention])).eval()
    kv = {}
    for i, block in enumerate(model.blocks):
        block.attn.register_forward_hook(lambda mod, args, out, i=i: kv.__setitem__(i, out[1]))
    for cache in (None, model.new_kv_cache(2)):
        model(torch.randint(0, 37, (2, 5)), kv_cache=cache)
        first = [t for t in (kv[0] if isinstance(kv[0], tuple) else (kv[0],))]
        shared = [t for t in (kv[1] if isinstance(kv[1], tuple) else (kv[1],))]
        assert all(a is b for a, b in zip(first, shared))
        if model.config.n_layer == 3:
            assert kv[2] is not kv[0]
    unshared = GPT(tiny_config(**ATTENTION[attention] | {"kv_share": 1}))
    sizes = [[sum(p.numel() for p in block.parameters()) for block in m.blocks] for m in (model, unshared)]
    assert sizes[0][1] < sizes[1][1]  # layer 1 lost its K/V projection
    assert sizes[0][0] == sizes[1][0] and sizes[0][2:] == sizes[1][2:]


def test_cache_ratio_is_n_head_to_n_kv_head_to_one():
    sizes = [GPT(tiny_config(n_kv_head=n)).new_kv_cache(1).nbytes for n in (4, 2, 1)]
    assert sizes[0] // sizes[2] == 4 and sizes[1] // sizes[2] == 2


def test_only_the_cache_moves_its_length():
    cache = GPT(tiny_config()).new_kv_cache(2, max_len=5)
    cache.advance(3)
    cache.advance(2)
    assert cache.length == 5
    with pytest.raises(RuntimeError, match="cache size 5"):
        cache.advance(1)
    cache.reset()
    assert cache.length == 0
    # Nothing outside model/kv_cache.py assigns a cache's length.
    sources = [p for p in ROOT.rglob("*.py") if ".venv" not in p.parts and p.name != "kv_cache.py"
               and "tests" not in p.parts]
    writers = [f"{p}:{i}" for p in sources for i, line in enumerate(p.read_text().splitlines(), 1)
               if re.search(r"\.length\s*(\+|-)?=[^=]", line)]
    assert writers == []


def test_rope_frequencies_made_by_a_generation_train_and_equal_the_formula():
    """RoPE's frequencies are made once and kept (a decode step's five operations fewer). Kept by a
    generation, under inference mode, they must still serve a training step's backward pass, with
    the gradients of frequencies made outside it; and they are the formula's, bit for bit."""
    from model.core.attention import rope_frequencies
    from model.rope import kept_rope_frequencies

    def gradients():
        model = tiny_model(seed=3, pos_emb="rope").train()
        idx = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(0))
        model(idx, idx)[1].backward()
        return [p.grad for p in model.parameters()]

    kept_rope_frequencies.cache_clear()
    expected = gradients()
    kept_rope_frequencies.cache_clear()
    with torch.inference_mode():
        generate(tiny_model(pos_emb="rope"), torch.zeros(1, 1, dtype=torch.long), 3)
    assert all(torch.equal(a, b) for a, b in zip(gradients(), expected))
    head_dim = tiny_config().head_dim
    assert torch.equal(kept_rope_frequencies(head_dim, 10000.0, None, torch.device("cpu")),
                       rope_frequencies(head_dim, 10000.0))


@pytest.mark.parametrize("tied", [True, False])
def test_a_padded_head_gives_the_same_logits_tokens_and_parameter_count(tied):
    """pad_head_rows (for_decoding's on CUDA): the head's rows a multiple of 64, a tied embedding
    sharing them; the logits are the unpadded head's, with and without the cache."""
    from model.decode_step import CompiledDecodeStep
    from model.generation import generate

    torch.manual_seed(0)
    model = GPT(tiny_config(tie_embeddings=tied, pos_emb="rope")).eval().requires_grad_(False)
    idx = torch.randint(0, 37, (2, 9))
    logits, n_params = model(idx), model.num_params()
    tokens = generate(model, idx[:1, :3], 12, temperature=0)
    model.pad_head_rows()
    assert model.lm_head.weight.shape == (64, 16) and not model.lm_head.weight[37:].any()
    assert (model.wte.weight is model.lm_head.weight) == tied and model.num_params() == n_params
    torch.testing.assert_close(model(idx), logits, rtol=0, atol=1e-6)
    assert model(idx).shape == (2, 9, 37)
    assert torch.equal(generate(model, idx[:1, :3], 12, temperature=0), tokens)
    step = CompiledDecodeStep(model, backend="aot_eager")
    assert torch.equal(generate(model, idx[:1, :3], 12, temperature=0, decode_step=step), tokens)
    assert model.pad_head_rows().lm_head.weight.shape == (64, 16)  # again: nothing more


def test_cache_overflow_is_an_error():
    model = GPT(tiny_config())
    cache = model.new_kv_cache(1, max_len=4)
    with pytest.raises(ValueError, match="cache size 4"):
        model(torch.zeros(1, 5, dtype=torch.long), kv_cache=cache)


# A cache of another model, and what the error says of it: (the cache's model, its rows, the words).
MISFITS = {"rows": ({}, 1, "1 row(s), fewer than the batch's 2"),
           "heads": ({"n_kv_head": 2}, 2, "2 K/V heads of 4, not the model's 4 of 4"),
           "MLA's latent": ({"mla_latent_dim": 8, "mla_rope_dim": 4}, 2, "an MLA latent per position"),
           "layers": ({"n_layer": 3}, 2, "3 layer groups, not the model's 2"),
           "shared layers": ({"kv_share": 2}, 2, "1 layer groups"),
           "dtype": ({"dtype": torch.bfloat16}, 2, "dtype torch.bfloat16, not the model's torch.float32"),
           "windows": ({"attn_window": 4}, 2, "other windows or sinks"),
           "sinks": ({"attn_window": 4, "attn_sinks": 2, "mine": {"attn_window": 4}}, 2, "windows or sinks")}


@pytest.mark.parametrize("kind", MISFITS)
@pytest.mark.parametrize("stored", [None, "int8"])
def test_a_cache_that_does_not_fit_is_one_error_before_anything_is_written(kind, stored):
    """Through the API, a cache of other rows, K/V heads, layers, dtype, windows or sinks than the
    model's: one ValueError that says which, and the cache as it was (nothing written, not advanced)."""
    overrides, rows, words = dict(MISFITS[kind][0]), *MISFITS[kind][1:]
    dtype, mine = overrides.pop("dtype", torch.float32), overrides.pop("mine", {})
    model = tiny_model(0, pos_emb="rope", **mine)
    cache = tiny_model(1, pos_emb="rope", **overrides).to(dtype).new_kv_cache(rows, dtype=stored)
    before = [t.clone() for t in cache.buffers]
    for tokens in (3, 1):  # a prefill, a step
        with pytest.raises(ValueError, match=re.escape(words)):
            model(torch.zeros(2, tokens, dtype=torch.long), kv_cache=cache)
    assert cache.length == 0 and all(torch.equal(a, b) for a, b in zip(before, cache.buffers))
    assert model.fits(model.new_kv_cache(2, dtype=stored), 2)


@pytest.mark.parametrize("overrides,field", [
    (dict(n_embd=18), "n_embd"),
    (dict(n_kv_head=3), "n_kv_head"),
    (dict(n_kv_head=0), "n_kv_head"),
    (dict(n_kv_head=8), "n_kv_head"),
    (dict(n_embd=24, n_head=8, pos_emb="rope"), "pos_emb"),
    (dict(pos_emb="alibi"), "pos_emb"),
    (dict(norm="batchnorm"), "norm"),
    (dict(mlp="relu"), "mlp"),
    (dict(attn_backend="flash"), "attn_backend"),
    (dict(n_layer=0), "n_layer"),
    (dict(vocab_size=None), "vocab_size"),
    (dict(dropout=1.0), "dropout"),
    (dict(kv_share=0), "kv_share"),
    (dict(kv_share=3), "kv_share"),  # more than n_layer = 2
    (dict(mla_latent_dim=0), "mla_latent_dim"),
    (dict(mla_rope_dim=2), "mla_rope_dim"),  # without mla_latent_dim
    (dict(mla_latent_dim=8, mla_rope_dim=-2), "mla_rope_dim"),
    (dict(mla_latent_dim=8, pos_emb="rope"), "mla_rope_dim"),  # RoPE needs the RoPE key
    (dict(mla_latent_dim=8, mla_rope_dim=3, pos_emb="rope"), "mla_rope_dim"),
    (dict(mla_latent_dim=8, n_kv_head=2), "n_kv_head"),
    (dict(mla_latent_dim=8, qk_norm=True), "qk_norm"),
    (dict(attn_window=0), "attn_window"),
    (dict(attn_window=25), "attn_window"),  # more than block_size = 24
    (dict(window_pattern="SL"), "window_pattern"),  # without attn_window
    (dict(attn_window=4, window_pattern="SX"), "window_pattern"),
    (dict(attn_window=4, window_pattern="LL"), "window_pattern"),  # no windowed layer
    (dict(attn_window=4, window_pattern="SLS"), "window_pattern"),  # longer than n_layer = 2
    (dict(attn_window=4, window_pattern=""), "window_pattern"),
    (dict(attn_window=4, window_pattern="SL", kv_share=2), "window_pattern"),  # a group of two windows
    (dict(attn_sinks=2), "attn_sinks"),  # without attn_window
    (dict(attn_window=4, attn_sinks=-1), "attn_sinks"),
    (dict(attn_sink_logit=1), "attn_sink_logit"),
])
def test_invalid_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=rf"GPTConfig\.{field}\b"):
        tiny_config(**overrides)


@pytest.mark.parametrize("arch", [
    dict(),
    dict(pos_emb="rope", norm="rmsnorm", mlp="swiglu", qk_norm=True, tie_embeddings=False, bias=False),
    dict(pos_emb="rope", mla_latent_dim=8, mla_rope_dim=2, n_kv_head=None),
    dict(kv_share=2, n_kv_head=1),
    dict(pos_emb="rope", attn_window=4, window_pattern="SL", attn_sinks=1, attn_sink_logit=True),
])
def test_tiny_model_overfits_one_batch(arch):
    torch.manual_seed(0)
    model = GPT(tiny_config(**({"n_kv_head": 2} | arch)))
    idx = torch.randint(0, 37, (4, 17))
    x, y = idx[:, :-1], idx[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(80):  # under 0.5 by step 40 for every arch (and seed 0 to 3); ~0.05 at step 80
        _, loss = model(x, y)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert first > 3.0 and loss.item() < 0.5
