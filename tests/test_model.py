import pytest
import torch
import torch.nn.functional as F

from model import GPT, GPTConfig, attend

VARIANTS = {"mha": 4, "gqa": 2, "mqa": 1}  # n_kv_head for n_head = 4


def tiny(**overrides) -> GPTConfig:
    kw = dict(vocab_size=37, block_size=24, n_layer=2, n_head=4, n_embd=16)
    return GPTConfig(**(kw | overrides))


@pytest.mark.parametrize("n_kv_head", VARIANTS.values(), ids=VARIANTS.keys())
@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("T,S", [(7, 7), (3, 7), (1, 7)])
def test_naive_and_sdpa_agree(n_kv_head, is_causal, T, S):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, T, 8, generator=g)
    k, v = torch.randn(2, 2, n_kv_head, S, 8, generator=g).unbind(0)
    naive, weights = attend(q, k, v, is_causal=is_causal, backend="naive", return_weights=True)
    sdpa = attend(q, k, v, is_causal=is_causal, backend="sdpa")
    torch.testing.assert_close(naive, sdpa, atol=1e-5, rtol=0)
    assert weights.shape == (2, 4, T, S)
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, T))


def test_causal_mask_is_bottom_right_aligned():
    q, k, v = torch.randn(1, 1, 2, 4), torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4)
    _, weights = attend(q, k, v, backend="naive", return_weights=True)
    # The 2 queries are positions 3 and 4 of 5: the first sees keys 0..3, the second all.
    assert (weights[0, 0, 0, 4] == 0) and (weights[0, 0, 0, :4] > 0).all()
    assert (weights[0, 0, 1] > 0).all()


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
@pytest.mark.parametrize("n_kv_head", [2, 1])
def test_grouped_attention_equals_mha_on_repeated_kv(backend, n_kv_head):
    q, k, v = torch.randn(2, 4, 5, 8), torch.randn(2, n_kv_head, 5, 8), torch.randn(2, n_kv_head, 5, 8)
    n_rep = 4 // n_kv_head
    grouped = attend(q, k, v, backend=backend)
    repeated = attend(q, k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1), backend=backend)
    torch.testing.assert_close(grouped, repeated, atol=1e-6, rtol=0)


def test_attend_equals_textbook_formula():
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    scores = q @ k.transpose(-2, -1) / 8**0.5
    scores = scores.masked_fill(torch.ones(4, 4).triu(1).bool(), float("-inf"))
    torch.testing.assert_close(attend(q, k, v), F.softmax(scores, -1) @ v)


def test_gqa_with_n_kv_head_equal_n_head_is_mha():
    mha = GPT(tiny())  # n_kv_head defaults to n_head
    gqa = GPT(tiny(n_kv_head=4))
    assert gqa.num_params() == mha.num_params()
    gqa.load_state_dict(mha.state_dict())
    idx = torch.randint(0, 37, (2, 10))
    assert torch.equal(mha(idx), gqa(idx))


def test_fewer_kv_heads_mean_fewer_parameters():
    counts = [GPT(tiny(n_kv_head=n)).num_params() for n in (4, 2, 1)]
    assert counts[0] > counts[1] > counts[2]
    # Each K/V head less saves a (n_embd x hd) weight and an hd bias in K and in V, per layer.
    assert counts[0] - counts[1] == 2 * 2 * 2 * (16 * 4 + 4)


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize("backend", ["sdpa", "naive"])
def test_causality(pos_emb, backend):
    model = GPT(tiny(pos_emb=pos_emb, attn_backend=backend, n_kv_head=2)).eval()
    idx = torch.randint(0, 37, (1, 12))
    changed = idx.clone()
    changed[0, 6] = (idx[0, 6] + 1) % 37
    a, b = model(idx), model(changed)
    assert torch.equal(a[:, :6], b[:, :6])
    assert not torch.allclose(a[:, 6:], b[:, 6:])


@pytest.mark.parametrize("n_kv_head", VARIANTS.values(), ids=VARIANTS.keys())
@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize("backend", ["sdpa", "naive"])
def test_cache_prefill_then_decode_equals_full_forward(n_kv_head, pos_emb, backend):
    config = tiny(n_kv_head=n_kv_head, pos_emb=pos_emb, attn_backend=backend, qk_norm=True)
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
    model = GPT(tiny(pos_emb=pos_emb, n_kv_head=2)).eval()
    short, long = torch.randint(0, 37, (1, 5)), torch.randint(0, 37, (1, 9))
    batch = torch.cat([torch.cat([torch.zeros(1, 4, dtype=torch.long), short], 1), long])
    pad = torch.tensor([4, 0])
    padded = model(batch, pad=pad)
    torch.testing.assert_close(padded[0, 4:], model(short)[0], atol=1e-5, rtol=0)
    torch.testing.assert_close(padded[1], model(long)[0], atol=1e-5, rtol=0)
    assert not padded.isnan().any()


@pytest.mark.parametrize("n_kv_head", VARIANTS.values(), ids=VARIANTS.keys())
def test_cache_bytes_follow_the_formula(n_kv_head):
    config = tiny(n_kv_head=n_kv_head)
    cache = GPT(config).new_kv_cache(batch_size=3, max_len=10)
    hd = config.n_embd // config.n_head
    assert cache.nbytes == 2 * config.n_layer * n_kv_head * hd * 10 * 3 * 4
    assert cache.bytes_per_token == 2 * config.n_layer * n_kv_head * hd * 4


def test_cache_ratio_is_n_head_to_n_kv_head_to_one():
    sizes = [GPT(tiny(n_kv_head=n)).new_kv_cache(1).nbytes for n in (4, 2, 1)]
    assert sizes[0] // sizes[2] == 4 and sizes[1] // sizes[2] == 2


def test_cache_overflow_is_an_error():
    model = GPT(tiny())
    cache = model.new_kv_cache(1, max_len=4)
    with pytest.raises(ValueError, match="cache size 4"):
        model(torch.zeros(1, 5, dtype=torch.long), kv_cache=cache)


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
])
def test_invalid_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=rf"GPTConfig\.{field}\b"):
        tiny(**overrides)


@pytest.mark.parametrize("arch", [
    dict(),
    dict(pos_emb="rope", norm="rmsnorm", mlp="swiglu", qk_norm=True, tie_embeddings=False, bias=False),
])
def test_tiny_model_overfits_one_batch(arch):
    torch.manual_seed(0)
    model = GPT(tiny(n_kv_head=2, **arch))
    idx = torch.randint(0, 37, (4, 17))
    x, y = idx[:, :-1], idx[:, 1:]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(200):
        _, loss = model(x, y)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert first > 3.0 and loss.item() < 0.5
