"""model/kv_cache.py: the precision a cache stores in (float32, bfloat16, int8 with one scale per
position and K/V head), its exact size, and the ring a sliding-window model decodes through."""

import math

import pytest
import torch

from model import GPT
from model.kv_cache import Converted, GroupCache, Int8, KVCache, Ring, Stored, quantize_rows
from tests.helpers import ATTENTION, tiny_config

# What each storage costs against the float32 cache, on the logits of a tiny random model.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-3, torch.int8: 2e-3}


def test_int8_rows_round_to_within_half_a_step_of_their_scale():
    x = torch.randn(3, 2, 5, 16) * torch.logspace(-6, 3, 5)[:, None]     # rows of very different sizes
    x[0, 0, 0] = 0                                                       # and one of zeros
    q, scale = quantize_rows(x)
    assert q.dtype == torch.int8 and scale.shape == (3, 2, 5, 1)
    assert (q.abs().amax(-1) == 127).sum() == x[..., 0].numel() - 1      # every non-zero row uses the range
    assert ((q * scale - x).abs() <= scale / 2 * (1 + 1e-6)).all()
    assert not q[0, 0, 0].any() and scale[0, 0, 0] == 0


@pytest.mark.parametrize("attention", ATTENTION.values(), ids=ATTENTION.keys())
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_int8_cache_bytes_are_values_plus_scales_exactly(attention, model_dtype):
    """Per position: every K and V number in one byte, plus one scale (in the model's dtype) per
    K/V head for K and for V, or per layer for MLA's latent (its values are inside its keys)."""
    config = tiny_config(**attention)
    model = GPT(config).to(model_dtype)
    cache = model.new_kv_cache(batch_size=3, max_len=10, dtype=torch.int8)
    layers = math.ceil(config.n_layer / config.kv_share)
    if config.mla_latent_dim is None:
        numbers, scales = 2 * config.n_kv_head * config.head_dim, 2 * config.n_kv_head
    else:
        numbers, scales = config.mla_latent_dim + config.mla_rope_dim, 1
    assert cache.bytes_per_token == layers * (numbers + scales * model_dtype.itemsize)
    assert cache.nbytes == cache.bytes_per_token * 3 * 10
    full = model.new_kv_cache(batch_size=3, max_len=10, dtype=torch.float32)
    assert full.bytes_per_token == layers * numbers * 4


@pytest.mark.parametrize("attention", ["mha", "gqa", "mqa_cla2", "mla"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_every_cache_dtype_decodes_what_its_teacher_forced_prefill_computes(attention, dtype):
    """A prefill through a cache attends to the keys and values as the cache holds them, so it
    computes what decoding one token at a time through it does (this is how the study scores a
    cache's precision); both are within the storage's rounding of the float32 forward."""
    model = GPT(tiny_config(pos_emb="rope", **ATTENTION[attention])).eval()
    idx = torch.randint(0, 37, (2, 20))
    with torch.no_grad():
        full = model(idx)
        prefill = model(idx, kv_cache=model.new_kv_cache(2, dtype=dtype))
        cache = model.new_kv_cache(2, dtype=dtype)
        steps = torch.cat([model(idx[:, t:t + 1], kv_cache=cache) for t in range(20)], dim=1)
    torch.testing.assert_close(steps, prefill, atol=1e-5, rtol=0)
    error = (prefill - full).abs().max().item()
    assert error < TOLERANCE[dtype] and (dtype == torch.float32) == (error < 1e-5), error


@pytest.mark.parametrize("attention", ["mha", "gqa", "mqa_cla2", "mla"])
def test_a_window_model_decodes_through_a_ring_of_window_cells_past_block_size(attention):
    """3x past block_size (24), one token at a time, after a prefill longer than the window: the
    logits of the whole sequence recomputed under the window mask, and the cache never more than
    the window's positions."""
    model = GPT(tiny_config(pos_emb="rope", attn_window=5, **ATTENTION[attention])).eval()
    idx = torch.randint(0, 37, (2, 80))
    cache = model.new_kv_cache(2)
    assert cache.ring and cache.max_len == 5 and cache.nbytes == cache.bytes_per_token * 2 * 5
    with torch.no_grad():
        full = model(idx)
        steps = [model(idx[:, :9], kv_cache=cache)] + [model(idx[:, t:t + 1], kv_cache=cache)
                                                       for t in range(9, 80)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
    assert cache.length == 80 and cache.nbytes == cache.bytes_per_token * 2 * 5
    # A later chunk of several tokens goes in one at a time, to the same logits.
    cache.reset()
    with torch.no_grad():
        chunks = [model(idx[:, :3], kv_cache=cache), model(idx[:, 3:40], kv_cache=cache)]
    torch.testing.assert_close(torch.cat(chunks, dim=1), full[:, :40], atol=1e-5, rtol=0)


def test_a_window_cache_shorter_than_the_window_is_a_plain_one():
    model = GPT(tiny_config(pos_emb="rope", attn_window=8))
    short, whole = model.new_kv_cache(1, max_len=6), model.new_kv_cache(1)
    assert (short.ring, short.max_len) == (False, 6) and (whole.ring, whole.max_len) == (True, 8)
    with pytest.raises(ValueError, match="7 positions exceed the cache size 6"):
        model(torch.zeros(1, 7, dtype=torch.long), kv_cache=short)


@pytest.mark.parametrize("window,sinks,max_len,rings", [
    (24, 2, 24, True),    # window = block: the ring holds the window and the sinks, past max_len
    (23, 3, 24, True),
    (8, 2, 7, False),     # max_len below the window: positions never outrun a plain cache
])
def test_an_all_window_cache_rings_whenever_its_window_fits_max_len(window, sinks, max_len, rings):
    """Every layer windowed: the cache takes positions without end whenever max_len reaches the
    window, its ring then holding sinks + window cells even where that exceeds max_len; with a
    layer over the whole context, a windowed layer rings only where sinks + window fit (the cache
    refills at max_len)."""
    model = GPT(tiny_config(pos_emb="rope", attn_window=window, attn_sinks=sinks))
    cache = model.new_kv_cache(1, max_len)
    cells = [group.cells for group in cache.groups]
    assert cache.ring == rings and cells == [sinks + window if rings else max_len] * 2
    mixed = GPT(tiny_config(pos_emb="rope", n_layer=2, attn_window=window, attn_sinks=sinks,
                            window_pattern="SL")).new_kv_cache(1, max_len)
    assert not mixed.ring and mixed.max_len == max_len
    assert [g.ring for g in mixed.groups] == [max_len >= sinks + window, False]


@pytest.mark.parametrize("dtype,compute_dtype,message", [
    (torch.int32, None, "dtype must be one of float32, bfloat16, int8"),
    (torch.float16, None, "dtype must be one of"),
    ("int5", None, "dtype must be one of"),
    (torch.int8, torch.int8, "compute_dtype must be a floating-point dtype"),
])
def test_a_cache_built_directly_refuses_a_dtype_it_cannot_hold(dtype, compute_dtype, message):
    with pytest.raises(ValueError, match=message):
        KVCache([None], 1, 2, 8, 4, dtype=dtype, compute_dtype=compute_dtype)


def test_a_cache_over_other_tensors_writes_them_and_leaves_its_own():
    """`over` (what torch.export traces the compiled CPU step with): the same cache, its memory the
    tensors given in `tensors`' order, an int8 cache's scales and read buffer included."""
    cache = KVCache([None, 4], 2, 2, 6, 3, dtype=torch.int8, compute_dtype=torch.float32)
    others = [torch.zeros_like(t) for t in cache.tensors]
    view = cache.over(others)
    assert [t is o for t, o in zip(view.tensors, others)] == [True] * len(others)
    k, v = torch.randn(2, 2, 1, 3), torch.randn(2, 2, 1, 3)
    view.groups[1].update(torch.tensor([0]), k, v)
    assert all(not t.any() for t in cache.buffers)                      # its own: untouched
    assert view.groups[1].k.tensors[0][:, :, 0].any() and view.groups[1].v.tensors[1][:, :, 0].any()


def test_the_plain_cache_stores_at_the_positions_given_and_reads_its_own_memory():
    """The core every other kind builds on: one group's GroupCache over two plain Stored tensors,
    position p in cell p. A chunk into an empty cache reads back what it was given; a later one reads
    the first `read` cells, a view of the cache's own tensors (nothing copied a step); a batch smaller
    than the cache uses its first rows."""
    group = GroupCache(Stored(3, 2, 8, 4, torch.float32, None), Stored(3, 2, 8, 4, torch.float32, None))
    k, v = torch.randn(3, 2, 5, 4), torch.randn(3, 2, 5, 4)
    read_k, read_v = group.update(torch.arange(5), k, v, cells_read=5)
    assert read_k is k and read_v is v and torch.equal(group.k.tensors[0][:, :, :5], k)
    k1, v1 = torch.randn(2, 2, 1, 4), torch.randn(2, 2, 1, 4)                 # 2 of the 3 rows
    read_k, read_v = group.update(torch.tensor([5]), k1, v1, cells_read=6)
    assert read_k.shape == (2, 2, 6, 4) and read_k.data_ptr() == group.k.tensors[0].data_ptr()
    assert torch.equal(read_k, torch.cat([k[:2], k1], dim=2))
    assert torch.equal(read_v, torch.cat([v[:2], v1], dim=2))
    assert not group.k.tensors[0][2, :, 5].any() and not group.k.tensors[0][:, :, 6:].any()


def test_the_models_cache_holds_one_group_cache_per_group_each_its_own():
    cache = KVCache([None, None], batch_size=3, n_kv_head=2, max_len=8, key_dim=4)
    cache.groups[1].update(torch.arange(5), torch.randn(3, 2, 5, 4), torch.randn(3, 2, 5, 4), cells_read=5)
    assert cache.groups[1].k.tensors[0].any() and not cache.groups[0].k.tensors[0].any()


@pytest.mark.parametrize("dtype,stored", [(torch.float32, Stored), (torch.bfloat16, Converted),
                                          (torch.int8, Int8)])
def test_where_positions_go_and_how_they_are_kept_are_chosen_apart_per_group(dtype, stored):
    """A windowed group rings and a full one is plain, whatever the cache stores in; every group
    keeps K and V in the one storage its dtype asks for (MLA: V inside K, so K alone)."""
    cache = KVCache([4, None], 1, 2, 8, 4, dtype=dtype, compute_dtype=torch.float32)
    assert [type(group) for group in cache.groups] == [Ring, GroupCache]
    assert [type(s) for _, _, s in cache.stores()] == [stored] * 4
    latent = KVCache([4, None], 1, 1, 8, 6, value_dim_in_keys=4, dtype=dtype, compute_dtype=torch.float32)
    assert [name for _, name, _ in latent.stores()] == ["k", "k"]
