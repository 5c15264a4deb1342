"""model/kv_cache.py's int4 cache (`Int4`): int4 numbers in groups with a scale each, and the last
int4_recent positions also as given. Its one rule, a query at i reads position j as given iff
i - j < int4_recent, else as int4, checked against a reference written here and against itself
however a prompt is fed; its bytes, its round trip, and what refuses it."""

import math

import pytest
import torch

import model.attention  # noqa: F401  (registers the int4 cache's kernel with `attend`)
from model.core.attention import attend
from model.decode_step import CompiledDecodeStep
from model.generation import Decoding
from model.kv_cache import KVCache, MixedKeys, dequantize_groups, pack_int4, quantize_groups, unpack_int4
from model.timing import decode_tokens_per_s
from tests.helpers import ATTENTION, tiny_config, tiny_model

ROPE = {"pos_emb": "rope"}


def int4_cache(model, rows=1, recent=3, group=2, **kwargs):
    return model.new_kv_cache(rows, dtype="int4", int4_recent=recent, int4_group=group, **kwargs)


def fed(model, idx, cache, chunk, starts=None):
    """The logits (B, T, vocab) of idx (B, T) run through `cache` `chunk` tokens at a time."""
    return torch.cat([model(idx[:, t:t + chunk], kv_cache=cache, starts=starts)
                      for t in range(0, idx.size(1), chunk)], dim=1)


# ----------------------------------------------------------------------------- the rule, however fed

@pytest.mark.parametrize("attention", ["mha", "gqa", "mla", "mqa_cla2"])
@pytest.mark.parametrize("recent", [0, 1, 4])
@torch.no_grad()
def test_a_prompt_gives_the_logits_of_decoding_it_one_token_at_a_time(attention, recent):
    """One token at a time, the last `recent` positions as given and the older int4, is the rule; a
    one-shot prefill and chunks of 3 read each position as each of their queries would alone."""
    model = tiny_model(**ROPE, **ATTENTION[attention])
    idx = torch.randint(0, 37, (2, 17), generator=torch.Generator().manual_seed(1))
    steps = fed(model, idx, int4_cache(model, 2, recent), 1)
    for chunk in (17, 3):
        chunked = fed(model, idx, int4_cache(model, 2, recent), chunk)
        torch.testing.assert_close(chunked, steps, atol=1e-5, rtol=0)
    if recent == 4:  # and the int4 part is read: not the float32 cache's logits
        assert (steps - fed(model, idx, model.new_kv_cache(2), 1)).abs().max() > 1e-4


@pytest.mark.parametrize("attention", ["gqa", "mla"])
@torch.no_grad()
def test_left_padded_rows_read_what_each_row_alone_reads(attention):
    """Rows of different lengths left-padded (`starts`): each row's logits, fed at once, in chunks or a
    token at a time, are its own fed a token at a time alone (distances count in columns alike)."""
    model = tiny_model(**ROPE, **ATTENTION[attention])
    gen = torch.Generator().manual_seed(2)
    rows = [torch.randint(0, 37, (1, n), generator=gen) for n in (11, 18)]
    pad = torch.tensor([7, 0])
    idx = torch.cat([torch.cat([torch.zeros(1, 7, dtype=torch.long), rows[0]], dim=1), rows[1]])  # (2, 18)
    alone = [fed(model, row, int4_cache(model, 1, 5), 1)[0] for row in rows]
    for chunk in (18, 4, 1):
        padded = fed(model, idx, int4_cache(model, 2, 5), chunk, starts=pad)
        torch.testing.assert_close(padded[0, 7:], alone[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(padded[1], alone[1], atol=1e-5, rtol=0)


def reference_int4(x, group):
    """x (B, heads, S, D) as int4 read back, written apart from the cache's: each group of `group`
    numbers on its own, scale = its largest magnitude / 7, each number rounded to a step and clamped."""
    out = torch.empty_like(x)
    for g in range(x.size(-1) // group):
        part = x[..., g * group:(g + 1) * group]
        scale = part.abs().amax(dim=-1, keepdim=True) / 7
        steps = torch.where(scale > 0, part / torch.where(scale > 0, scale, 1), 0)
        out[..., g * group:(g + 1) * group] = steps.round().clamp(-7, 7) * scale
    return out


def reference_attention(q, k, v, recent, group):
    """Per query i and position j <= i, K and V of j as given if i - j < recent, else as int4: the
    output (B, n_head, S, D) and weights (B, n_head, S, S), a loop over the queries."""
    B, n_head, S, D = q.shape
    n_rep = n_head // k.size(1)
    k, v = (x.repeat_interleave(n_rep, dim=1) for x in (k, v))             # (B, n_head, S, D)
    k4, v4 = reference_int4(k, group), reference_int4(v, group)
    out, weights = torch.zeros_like(q), torch.zeros(B, n_head, S, S)
    for i in range(S):
        given = (i - torch.arange(i + 1) < recent)[:, None]                   # (i + 1, 1)
        keys = torch.where(given, k[:, :, :i + 1], k4[:, :, :i + 1])         # (B, n_head, i + 1, D)
        values = torch.where(given, v[:, :, :i + 1], v4[:, :, :i + 1])
        w = torch.softmax(q[:, :, i:i + 1] @ keys.transpose(-2, -1) / math.sqrt(D), dim=-1)  # (B, ., 1, .)
        out[:, :, i:i + 1], weights[:, :, i, :i + 1] = w @ values, w[:, :, 0]
    return out, weights


@pytest.mark.parametrize("recent", [0, 3, 40])
def test_every_query_reads_each_position_as_the_distance_rule_says(recent):
    """A cache of one layer group fed random K and V in chunks of 5, 1, 3, 1, 7: what `attend` computes
    over what it reads, with the weights per cell, is the per-(i, j) reference."""
    gen = torch.Generator().manual_seed(3)
    B, n_head, n_kv_head, S, D, G = 2, 4, 2, 17, 8, 4
    q, k, v = (torch.randn(B, heads, S, D, generator=gen) for heads in (n_head, n_kv_head, n_kv_head))
    group = KVCache([None], B, n_kv_head, 20, D, dtype="int4", int4_recent=recent, int4_group=G).groups[0]
    expected, expected_weights = reference_attention(q, k, v, recent, G)
    start = 0
    for T in (5, 1, 3, 1, 7):
        at = torch.arange(start, start + T)
        keys, values = group.update(at, k[:, :, at], v[:, :, at], start + T)
        out, weights = attend(q[:, :, at], keys, values, backend="naive", return_weights=True)
        torch.testing.assert_close(out, expected[:, :, at], atol=1e-5, rtol=0)
        torch.testing.assert_close(weights, expected_weights[:, :, at, :start + T], atol=1e-6, rtol=0)
        assert torch.allclose(attend(q[:, :, at], keys, values), out, atol=1e-5, rtol=0)  # SDPA too
        start += T
    assert isinstance(keys, MixedKeys) == (recent == 3)  # (0: all int4, 40: all as given, plain keys)


# ----------------------------------------------------------------------------- its two ends

@pytest.mark.parametrize("attention", ["gqa", "mla"])
@torch.no_grad()
def test_recent_positions_covering_the_sequence_give_the_float32_cache_exactly(attention):
    model = tiny_model(**ROPE, **ATTENTION[attention])
    idx = torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(4))
    for chunk in (8, 3, 1):
        expected = fed(model, idx, model.new_kv_cache(2), chunk)
        assert torch.equal(fed(model, idx, int4_cache(model, 2, 24), chunk), expected)
    tokens = []
    for cache in (model.new_kv_cache(2), int4_cache(model, 2, 100)):  # (100: all of max_len)
        logits, new = model(idx, kv_cache=cache)[:, -1:], []
        for _ in range(14):  # greedy, to the end of the cache
            new.append(logits.argmax(-1))                                    # (B, 1)
            logits = model(new[-1], kv_cache=cache)
        tokens.append(torch.cat(new, dim=1))
    assert torch.equal(tokens[0], tokens[1])


@torch.no_grad()
def test_with_no_recent_positions_a_step_reads_every_position_as_int4():
    gen = torch.Generator().manual_seed(5)
    B, heads, D, n = 2, 2, 8, 9
    group = KVCache([None], B, heads, 12, D, dtype="int4", int4_recent=0, int4_group=4).groups[0]
    k, v = torch.randn(B, heads, n, D, generator=gen), torch.randn(B, heads, n, D, generator=gen)
    group.update(torch.arange(n - 1), k[:, :, :-1], v[:, :, :-1], n - 1)
    keys, values = group.update(torch.tensor([n - 1]), k[:, :, -1:], v[:, :, -1:], n)
    stored_k, stored_v = (dequantize_groups(stored.tensors[0][:, :, :n], stored.tensors[1][:, :, :n])
                          for stored in (group.k, group.v))
    assert torch.equal(keys, stored_k) and torch.equal(values, stored_v)
    torch.testing.assert_close(stored_k, reference_int4(k, 4), atol=1e-6, rtol=0)
    q = torch.randn(B, 4, 1, D, generator=gen)
    assert torch.equal(attend(q, keys, values), attend(q, stored_k, stored_v))


# ----------------------------------------------------------------------------- bytes and numbers

@pytest.mark.parametrize("attention", ["mha", "gqa", "mla", "mqa_cla2"])
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_the_bytes_are_packed_numbers_scales_and_the_ring_exactly(attention, model_dtype):
    """Per layer group, K and V (MLA: the one latent): max_len positions of D/2 bytes and D/G scales,
    and a ring of R positions as given, in the model's dtype."""
    config = tiny_config(**ATTENTION[attention])
    model = tiny_model(**ATTENTION[attention]).to(model_dtype)
    rows, max_len, R, G = 3, 10, 4, 2
    cache = int4_cache(model, rows, R, G, max_len=max_len)
    layers = math.ceil(config.n_layer / config.kv_share)
    mla = config.mla_latent_dim is not None
    tensors, heads, D = (1, 1, config.mla_latent_dim + config.mla_rope_dim) if mla else (
        2, config.n_kv_head, config.head_dim)
    size = model_dtype.itemsize
    per_row = max_len * (D // 2 + D // G * size) + R * D * size
    assert cache.nbytes == rows * layers * tensors * heads * per_row
    assert cache.bytes_per_token == cache.nbytes // (rows * max_len)
    assert len(cache.buffers) == 3 * layers * tensors


def test_groups_round_to_within_half_a_step_and_pack_every_value_exactly():
    x = torch.randn(3, 2, 5, 16) * torch.logspace(-6, 3, 5)[:, None]         # rows of very different sizes
    x[0, 0, 0, :4] = 0                                                       # and a group of zeros
    packed, scales = quantize_groups(x, 4)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 2, 5, 8) and scales.shape == (3, 2, 5, 4)
    steps = scales.repeat_interleave(4, dim=-1)                              # (3, 2, 5, 16)
    back = dequantize_groups(packed, scales)
    assert ((back - x).abs() <= steps / 2 * (1 + 1e-6)).all()
    assert (unpack_int4(packed).abs().amax(-1) <= 7).all() and scales[0, 0, 0, 0] == 0
    q = torch.arange(-8, 8).repeat(2)[torch.randperm(32, generator=torch.Generator().manual_seed(6))]
    assert torch.equal(unpack_int4(pack_int4(q)), q.to(torch.int8))
    assert torch.equal(unpack_int4(pack_int4(q.view(2, 16))), q.view(2, 16).to(torch.int8))


# ----------------------------------------------------------------------------- what it refuses

@pytest.mark.parametrize("options, message", [
    ({"int4_recent": -1}, "int4_recent must be an integer >= 0"),
    ({"int4_recent": 2.0}, "int4_recent must be an integer >= 0"),
    ({"int4_recent": True}, "int4_recent must be an integer >= 0"),
    ({"int4_group": 3}, "int4_group must be an even integer >= 2 dividing the key width 4"),
    ({"int4_group": 0}, "int4_group must be an even integer >= 2"),
    ({"int4_group": 8}, "int4_group must be an even integer >= 2 dividing the key width 4"),
    ({"int4_group": "2"}, "int4_group must be"),
])
def test_bad_int4_options_are_refused_by_name(options, message):
    with pytest.raises(ValueError, match=message):
        tiny_model().new_kv_cache(1, dtype="int4", **options)


def test_where_an_int4_cache_is_refused():
    windowed = tiny_model(**ROPE, attn_window=6)
    with pytest.raises(ValueError, match="int4 cache holds every position, and windowed layers keep theirs"):
        int4_cache(windowed)
    int4_cache(windowed, ring=False)  # every layer holds max_len positions: the rule holds
    with pytest.raises(ValueError, match="kv_dtype must be one of float32, bfloat16, int8"):
        Decoding(kv_dtype="int4")
    with pytest.raises(ValueError, match="kv_dtype='int4': a compiled decode step does not take an int4"):
        CompiledDecodeStep(tiny_model(), kv_dtype="int4", backend="aot_eager")
    model = tiny_model()
    cache = int4_cache(model)
    model(torch.zeros(1, 5, dtype=torch.long), kv_cache=cache)
    with pytest.raises(ValueError, match="an int4 cache keeps all its 5 positions or none, not 3"):
        cache.truncate(3)
    cache.truncate(5)
    cache.truncate(0)
    assert cache.length == 0


@torch.no_grad()
def test_decode_speed_is_measured_through_an_int4_cache():
    model = tiny_model(**ROPE, block_size=512, n_embd=128)  # heads 32 wide: groups of 32
    assert decode_tokens_per_s(model, 1, 512, "int4", cache_options={"int4_recent": 32, "int4_group": 32}) > 0
    assert decode_tokens_per_s(tiny_model(), 2, 20, "int4", steps=2, cache_options={"int4_group": 4}) > 0
