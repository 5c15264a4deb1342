"""model/core/attention.py's `attend` (naive and SDPA agree, bottom-right causal mask, GQA/MQA
equal MHA on repeated K/V, the textbook formula, values wider or narrower than keys, an explicit
scale); model/windows.py's windows, sinks and checked arguments; model/kernels.py's kernel an int8
cache's one-query step runs (by the cache's size and the decode asked for), and split-KV's
configuration in a compiled step."""

import pytest
import torch
import torch.nn.functional as F

from model import attend
from model.generation import Decoding, stream
from model.kernels import (
    COMPILE_FROM,
    PAYS_FROM,
    SplitKV,
    attend_one_query,
    compiled_attend_one_query,
    compiling_pays,
    decode_kernel_options,
    one_query_kernel,
)
from model.kv_cache import KVCache, Quantized
from model.sampling import Sampling
from model.windows import attend_within, causal_mask
from tests.helpers import BOUNDED, ENDLESS, VARIANTS, cache_kind_model, tiny_model


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


MASKS = {  # the masks attend is given or builds, by shape (B=2, n_head=4 or 12, T=3, S=9)
    "none": lambda g, H: None,
    "(T, S)": lambda g, H: torch.rand(3, 9, generator=g) > 0.4,
    "(B, 1, T, S)": lambda g, H: torch.rand(2, 1, 3, 9, generator=g) > 0.4,
    "(B, n_head, T, S)": lambda g, H: torch.rand(2, H, 3, 9, generator=g) > 0.4,
}


@pytest.mark.parametrize("mask", MASKS, ids=MASKS.keys())
@pytest.mark.parametrize("n_head,n_kv_head,T", [(4, 2, 3), (4, 1, 3), (12, 4, 1), (12, 1, 1), (12, 3, 3)])
@pytest.mark.parametrize("window", [None, 4])
def test_folded_query_heads_equal_sdpa_with_enable_gqa(mask, n_head, n_kv_head, T, window):
    """GQA/MQA through SDPA with a mask: attend folds the query heads of each K/V head into its
    queries (an MHA-shaped call that the fused kernels take). The same numbers as SDPA's own
    enable_gqa (the formulation before) and as the naive backend, every mask shape."""
    g = torch.Generator().manual_seed(n_head * 10 + n_kv_head + T)
    q = torch.randn(2, n_head, T, 8, generator=g)
    k, v = torch.randn(2, 2, n_kv_head, 9, 8, generator=g).unbind(0)
    allowed = MASKS[mask](g, n_head)
    if allowed is not None:  # every query sees its own position (S - T + t): no row without a key
        allowed = allowed[..., :T, :] | torch.eye(9, dtype=torch.bool)[9 - T:]
    folded = attend_within(q, k, v, attn_mask=allowed, window=window)
    combined = causal_mask(T, 9, window=window) & (True if allowed is None else allowed)
    before = F.scaled_dot_product_attention(q, k, v, attn_mask=combined, enable_gqa=True)
    torch.testing.assert_close(folded, before, atol=1e-6, rtol=0)
    naive = attend_within(q, k, v, attn_mask=allowed, window=window, backend="naive")
    torch.testing.assert_close(folded, naive,
                               atol=1e-6, rtol=0)


def test_attend_equals_textbook_formula():
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)
    scores = q @ k.transpose(-2, -1) / 8**0.5
    scores = scores.masked_fill(torch.ones(4, 4).triu(1).bool(), float("-inf"))
    torch.testing.assert_close(attend(q, k, v), F.softmax(scores, -1) @ v)


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
@pytest.mark.parametrize("d_k,d_v", [(24, 28), (80, 64)])
@pytest.mark.parametrize("n_kv_head", [4, 1])
@pytest.mark.parametrize("T,S", [(6, 6), (2, 6), (1, 6)])
def test_values_of_another_width_than_keys(backend, d_k, d_v, n_kv_head, T, S):
    """Seed 000's worked example (d_k = 24, d_v = 28), and MLA's absorbed shape (one K/V head of
    width latent + RoPE, values the latent), against the textbook formula with a given scale."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, T, d_k, generator=g)
    k, v = torch.randn(2, n_kv_head, S, d_k, generator=g), torch.randn(2, n_kv_head, S, d_v, generator=g)
    for scale in (None, 0.3):
        out = attend(q, k, v, backend=backend, scale=scale)
        assert out.shape == (2, 4, T, d_v)
        kr, vr = k.repeat_interleave(4 // n_kv_head, 1), v.repeat_interleave(4 // n_kv_head, 1)
        scores = q @ kr.transpose(-2, -1) * (d_k**-0.5 if scale is None else scale)  # (2, 4, T, S)
        scores = scores.masked_fill(~torch.ones(T, S, dtype=torch.bool).tril(S - T), float("-inf"))
        torch.testing.assert_close(out, F.softmax(scores, -1) @ vr, atol=1e-5, rtol=0)


def test_bad_shapes_and_backends_name_the_problem():
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 3, 5, 8)
    with pytest.raises(ValueError, match="n_kv_head"):
        attend_within(q, k, k)
    with pytest.raises(ValueError, match="backend"):
        attend_within(q, q, q, backend="flash")
    with pytest.raises(ValueError, match="q and k of one width"):
        attend_within(q, torch.randn(1, 1, 5, 6), torch.randn(1, 1, 5, 8))
    with pytest.raises(ValueError, match="v with k's heads and positions"):
        attend_within(q, torch.randn(1, 1, 5, 8), torch.randn(1, 1, 4, 8))


@pytest.mark.parametrize("backend", ["naive", "sdpa"])
@pytest.mark.parametrize("T,S", [(7, 7), (3, 7), (1, 7)])
@pytest.mark.parametrize("window", [1, 3, 7])
def test_a_window_sees_the_last_window_keys_up_to_each_query(backend, T, S, window):
    """transformers' Mistral `sliding_window`: query i sees keys j with i - window < j <= i."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, T, 8, generator=g)
    k, v = torch.randn(2, 2, 2, S, 8, generator=g).unbind(0)
    i = torch.arange(S - T, S)[:, None]                                  # the queries' positions
    j = torch.arange(S)
    allowed = (j <= i) & (j > i - window)                                # (T, S)
    want = attend(q, k, v, is_causal=False, attn_mask=allowed, backend="naive")
    torch.testing.assert_close(attend_within(q, k, v, window=window, backend=backend), want, atol=1e-6,
                               rtol=0)
    if backend == "naive":
        _, weights = attend_within(q, k, v, window=window, backend=backend, return_weights=True)
        assert torch.equal(weights[0, 0] > 0, allowed)


@pytest.mark.parametrize("backend", ["sdpa", "naive"])
def test_sinks_stay_visible_beside_the_window(backend):
    """StreamingLLM: query i sees keys j <= i that are in its window (i - window < j) or among the
    first `sinks` positions, bottom-right aligned like the causal mask."""
    T, S, window, sinks = 5, 12, 3, 2
    i, j = torch.arange(S - T, S)[:, None], torch.arange(S)
    allowed = (j <= i) & ((j > i - window) | (j < sinks))               # (T, S)
    assert torch.equal(causal_mask(T, S, window=window, attn_sinks=sinks), allowed)
    q, k, v = torch.randn(2, 4, T, 8), torch.randn(2, 2, S, 8), torch.randn(2, 2, S, 8)
    want = attend(q, k, v, is_causal=False, attn_mask=allowed, backend="naive")
    torch.testing.assert_close(attend_within(q, k, v, window=window, attn_sinks=sinks, backend=backend),
                               want,
                               atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", ["sdpa", "naive"])
def test_a_learned_sink_logit_is_a_key_of_zero_value_in_every_softmax(backend):
    """gpt-oss: softmax over [scores, sink], the sink's share dropped: the weights sum to
    1 / (1 + exp(sink - logsumexp(scores))) < 1; a very negative sink is plain attention; the
    logit learns (its gradient reaches it)."""
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    sink = torch.tensor([0.0, 1.0, -2.0, 3.0], requires_grad=True)
    out = attend_within(q, k, v, sink_logit=sink, backend=backend)
    out.sum().backward()
    assert sink.grad is not None and sink.grad.abs().min() > 0
    _, weights = attend_within(q, k, v, sink_logit=sink.detach(), backend="naive", return_weights=True)
    scores = (q.view(2, 2, 2, 6, 8) @ k.unsqueeze(2).transpose(-2, -1) / 8 ** 0.5).view(2, 4, 6, 6)
    scores = scores.masked_fill(~causal_mask(6, 6), float("-inf"))
    kept = torch.sigmoid(scores.logsumexp(-1) - sink.detach()[:, None])  # (2, 4, 6)
    torch.testing.assert_close(weights.sum(-1), kept, atol=1e-6, rtol=0)
    torch.testing.assert_close(out.detach(), attend(q, k, v, backend="naive") * kept[..., None] / 1,
                               atol=1e-5, rtol=0)
    none = torch.full((4,), -1e4)
    torch.testing.assert_close(attend_within(q, k, v, sink_logit=none, backend=backend), attend(q, k, v),
                               atol=1e-6,
                               rtol=0)


def test_an_int8_cache_keeps_one_kernel_from_its_first_step_to_its_last():
    """An int8 cache's one-query step runs compiled from 2**18 numbers a group, judged by its whole cache
    (its rows and positions), not by the part a step reads: a stream reading past 2**18 numbers never
    stops mid-sample to compile (31 s for one step, against 0.4 s); a smaller cache never compiles.
    (Which kernel, not its run: compiling takes seconds, test_quantize runs inductor's code.)"""
    q = torch.zeros(2, 4, 1, 32)                                          # (B, n_head, 1, head_dim)
    per_position = 2 * 2 * 32                                             # 2 rows x 2 K/V heads x 32
    for positions, kernel in ((COMPILE_FROM // per_position - 1, attend_one_query),
                              (COMPILE_FROM // per_position, compiled_attend_one_query())):
        cache = KVCache([None], 2, 2, positions, 32, dtype=torch.int8)
        keys, scales = cache.groups[0].k.tensors                          # (2, 2, positions, 32), (.., 1)
        for read in (1, positions // 2, positions):  # the first step, one halfway, the last
            assert one_query_kernel(q, Quantized(keys[:, :, :read], scales[:, :, :read])) is kernel
        assert one_query_kernel(q[:1], Quantized(keys[:1, :, :1], scales[:1, :, :1])) is kernel  # fewer rows
        assert one_query_kernel(q, Quantized(keys, scales, may_compile=False)) is attend_one_query  # short


def stream_start(model, idx, new: int):
    """The first token of a greedy stream over an int8 cache asked for `new` tokens (its prompt's
    pass: no step run yet), and that cache."""
    caches = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: caches.append(kwargs["kv_cache"]),
                                           with_kwargs=True)
    try:
        token = next(stream(model, idx, Sampling(new, temperature=0), Decoding(kv_dtype="int8")))
    finally:
        hook.remove()
    return token, caches[-1]


def test_compiling_pays_where_the_numbers_a_decode_reads_save_a_compile():
    """The numbers a decode's steps read: every layer reads its group's cells written so far, at most
    all of them. SmolLM2-135M (30 layers, 3 K/V heads of 64) after 1,000 tokens: 60 new ones never pay
    (they once compiled, ~20-50 s, for ~0.5 s of decoding), ~580 do; twice the rows, sooner; a cache of
    1,060 cells (refilled past it) pays later; the layers sharing a group read it each."""
    def pays(rows, cells, new, groups=1, layers=30):
        cache = KVCache([None] * groups, rows, 3, cells, 64, dtype=torch.int8)
        return compiling_pays(cache, 1000, new - 1, layers)

    def reads(rows, cells, new):  # by hand: steps x layers x rows x heads x dim x the average cells read
        return (new - 1) * 30 * rows * 3 * 64 * min(cells, 1000 + (new - 1) / 2)

    first = next(n for n in range(1, 2000) if reads(1, 3000, n) >= PAYS_FROM)
    assert 500 < first < 700
    assert not pays(1, 3000, 60) and not pays(1, 3000, first - 1) and pays(1, 3000, first)
    assert pays(2, 3000, first - 200) and not pays(1, 3000, first - 200)
    assert not pays(1, 1060, first) and pays(1, 1060, 750)
    assert pays(1, 3000, first, groups=2) and not pays(1, 3000, first, groups=2, layers=15)
    assert not pays(1, 3000, 0) and not pays(1, 3000, 1)  # no step at all


@pytest.mark.parametrize("kind", [*ENDLESS, *BOUNDED])
def test_a_stream_picks_its_int8_kernel_once_by_the_decode_asked_for(kind):
    """Every cache kind: before its prompt's pass a stream marks every K and V of its int8 cache
    compiled or not for the whole sample (one kernel from its first step to its last), by what its
    steps will read: 8 new tokens never pay for compiling, 10^9 always do."""
    model = cache_kind_model((ENDLESS | BOUNDED)[kind])
    idx = torch.randint(0, 37, (2, 9))
    for new, pays in ((8, False), (10**9, True)):
        _, cache = stream_start(model, idx, new)
        assert {stored.may_compile for _, _, stored in cache.stores()} == {pays}, new
        assert compiling_pays(cache, 9, new - 1, model.config.n_layer) is pays


def test_a_short_int8_decode_over_a_large_cache_compiles_nothing():
    """A cache of more than COMPILE_FROM numbers a group (where the compiled kernel is the faster) and
    8 new tokens: they run as written and nothing is compiled, within int8's rounding of the float32
    model's logits; the same prompt asked for 3,000 tokens reads the cache through the compiled
    kernel (only its first token drawn: compiling takes seconds)."""
    from torch._dynamo.utils import counters

    model = tiny_model(n_layer=4, n_head=4, n_embd=128, block_size=4096, pos_emb="rope")  # heads of 32
    idx = torch.randint(0, 37, (4, 600))
    q = torch.zeros(4, 4, 1, 32)                                          # (B, n_head, 1, head_dim)
    graphs, logits = counters["stats"]["unique_graphs"], []
    hook = model.register_forward_hook(lambda module, args, out: logits.append(out[:, -1]))
    try:
        tokens = stream(model, idx, Sampling(8, temperature=0), Decoding(kv_dtype="int8"))
        new = torch.stack(list(tokens), dim=1)
    finally:
        hook.remove()
    assert counters["stats"]["unique_graphs"] == graphs
    with torch.no_grad():
        want = model(torch.cat([idx, new], dim=1))[:, 599:-1]            # (4, 8, vocab)
    assert (torch.stack(logits, dim=1) - want).abs().max() < 2e-3
    for asked, kernel in ((8, attend_one_query), (3000, compiled_attend_one_query())):
        _, cache = stream_start(model, idx, asked)
        assert cache.groups[0].k.tensors[0].numel() >= COMPILE_FROM
        assert one_query_kernel(q, cache.groups[0].k.read(4, cache.length, one_query=True)) is kernel


def test_split_kvs_kernel_options_in_a_compiled_step_keep_its_shared_memory_at_96_kb():
    """Below 16 rows (batch x K/V heads) inductor's default; from 16, 3 stages of tiles whose K and
    V take 16 KB a stage (at most 128 keys a tile, at least 16): GPT-2's heads of 64 in bf16 take
    tiles of 128, float32 or heads of 128 take 64. Only on a Hopper GPU or newer (SplitKV.hopper)."""
    assert decode_kernel_options(12, 64, 2) == {}
    assert decode_kernel_options(16, 64, 2) == {"num_stages": 3, "BLOCK_N": 128}
    for rows, head_dim, itemsize in [(48, 64, 2), (3072, 128, 2), (16, 64, 4), (16, 16, 4), (64, 512, 4)]:
        tile = decode_kernel_options(rows, head_dim, itemsize)["BLOCK_N"]
        assert 16 <= tile <= 128 and 128 % tile == 0
        assert tile * head_dim * itemsize <= 16384 or tile == 16, (rows, head_dim, itemsize)
    assert decode_kernel_options(3072, 128, 2)["BLOCK_N"] == decode_kernel_options(16, 64, 4)["BLOCK_N"] == 64
    with SplitKV():
        assert SplitKV.hopper == (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0))
