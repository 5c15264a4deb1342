"""model/recorder.py: DecodeRecorder: what it keeps of a decode is the decode's own, for every
attention option and cache kind: the tokens it printed, the cell layout a cache of that kind must have, and
weights equal to the naive backend's over the same context, uncached."""

import functools

import pytest
import torch

from model.generation import Decoding, left_pad, stream
from model.recorder import MAX_WEIGHTS, DecodeRecorder, weights_to_record
from model.sampling import Sampling
from tests.helpers import ATTENTION, BOUNDED, ENDLESS, cache_kind_model, tiny_config, tiny_model

# Every attention option with RoPE, and full attention with learned positions; a prompt of 30 tokens
# with 12 new is past block_size (24): full layers refill, rings wrap, a long prompt is cut.
MODELS = {name: lambda o=o: cache_kind_model(o) for name, o in (ATTENTION | ENDLESS | BOUNDED).items()}
MODELS["learned positions"] = lambda: tiny_model()
PROMPT, NEW = 30, 12
CACHES = {"float32": dict(kv_cache=True), "int8": dict(kv_cache=True, kv_dtype="int8"),
          "no cache": dict(kv_cache=False), "chunks of 4": dict(kv_cache=True, prefill_chunk=4)}


def recorded(model, prompt, *others, **kw):
    """(the tokens a greedy decode yields as the recorder watches it, its record): of `prompt`, the
    batch's first row, with `others` after it, all left-padded to the longest."""
    idx, pad = left_pad([prompt, *others], "cpu")
    with DecodeRecorder(model, prompt) as recorder:
        steps = recorder.watch(stream(model, idx, Sampling(NEW, 0), Decoding(**kw), pad=pad))
        tokens = [int(t[0]) for t in steps]
    return tokens, recorder.record()


@functools.cache
@torch.no_grad()
def naive_weights(model, ids: tuple[int, ...]) -> list[torch.Tensor]:
    """Per layer, (n_head, len(ids)): the last query's weights over `ids` at positions 0.., uncached,
    as the naive backend computes them (once per model and context: the cache kinds share them)."""
    for block in model.blocks:
        block.attn.keep_weights = True
    try:
        model(torch.tensor([ids]))
        return [block.attn.weights[0, :, -1] for block in model.blocks]
    finally:
        for block in model.blocks:
            block.attn.keep_weights, block.attn.weights = False, None


def check_layout(step, s, n, record, config):
    """The cells a cache of this kind holds after the step that fed tokens 0 .. n-1, and which it
    just wrote; without a cache, the context."""
    cache = record["cache"]
    if cache is None:
        (group,) = step["groups"]
        assert group["seq"] == list(range(n - len(group["seq"]), n)) and group["written"] == []
        assert len(group["seq"]) == min(n, config.context_size or n)
        return
    for g, (kind, group) in enumerate(zip(cache["groups"], step["groups"])):
        seq, written = group["seq"], group["written"]
        if not kind["ring"]:  # position p in cell p, from the token at position 0
            assert seq == list(range(step["offset"], n)), (g, seq)
        else:  # sinks keep the first tokens; the ring the last `window`, in cyclic order
            k, w = cache["sinks"], kind["window"]
            start = step["offset"]  # the token at position 0 (after a refill, the first kept)
            assert seq[:k] == list(range(start, start + k))  # (n > k here)
            ring = {j: q for j, q in enumerate(seq) if j >= k and q >= 0}
            assert sorted(ring.values()) == list(range(max(n - w, start + k), n)), (g, seq)
            first = min(ring)
            assert all((q - ring[first]) % w == (j - first) % w for j, q in ring.items())
        if s == 0 or step["refill"] is not None:
            assert written == [j for j, q in enumerate(seq) if q >= 0]
        else:
            assert written == [seq.index(n - 1)]
    if step["refill"] is not None:  # a full cache keeps its last block_size // 2 - 1 tokens
        assert step["refill"] == config.block_size // 2 - 1 and step["offset"] == n - config.block_size // 2


def check_weights(model, record, kind):
    """Each step's weights, cell by cell, are the naive backend's over the context its first row
    has alone (from the token at position 0), uncached; a cell holds a token of that context or
    none (-1: empty, or padding of the batch), and a cell holding none has no weight."""
    tolerance = 3e-2 if kind == "int8" else 1e-6  # int8: the weights over K rounded to 8 bits
    for s, step in enumerate(record["steps"]):
        n = record["prompt_len"] + s  # tokens fed when this step's forward ran
        reference = naive_weights(model, tuple(record["tokens"][step["offset"]:n]))
        for layer, weights in enumerate(step["weights"]):
            group = step["groups"][record["model"]["layer_group"][layer] if record["cache"] else 0]
            assert all(q == -1 or step["offset"] <= q < n for q in group["seq"]), (kind, s, group["seq"])
            seq = torch.tensor(group["seq"])
            page = torch.tensor(weights, dtype=torch.float64)                       # (n_head, used)
            held = seq >= 0
            ref = reference[layer].double()[:, seq[held] - step["offset"]]         # (n_head, held)
            torch.testing.assert_close(page[:, held], ref, atol=tolerance, rtol=0, msg=f"{kind} {s}")
            assert (page[:, ~held] == 0).all()
            torch.testing.assert_close(page.sum(-1), reference[layer].double().sum(-1),
                                       atol=tolerance + 1e-5, rtol=0)


def check_bound(record, config, kv_cache):
    """weights_to_record bounds the weights the recording keeps: exactly where every cache group is a
    ring (full after the prompt) or, uncached, the context runs from the first token (sinks) or is
    the model's receptive field."""
    kept = sum(len(head) for step in record["steps"] for layer in step["weights"] for head in layer)
    bound = weights_to_record(config, PROMPT, NEW, kv_cache)
    assert kept <= bound
    if config.max_positions is None:
        assert kept == bound, (kept, bound)


@pytest.mark.parametrize("name", MODELS)
def test_the_record_is_the_decodes_own(name):
    model = MODELS[name]()
    torch.manual_seed(3)
    prompt = torch.randint(0, 37, (PROMPT,)).tolist()
    for kind, kw in CACHES.items():
        tokens, record = recorded(model, prompt, **kw)
        # The tokens it printed: those of the same decode unwatched.
        plain = [int(t[0]) for t in stream(model, torch.tensor([prompt]), Sampling(NEW, 0), Decoding(**kw))]
        assert tokens == plain and record["tokens"] == prompt + tokens, kind
        assert len(record["steps"]) == NEW and [s["token"] for s in record["steps"]] == tokens
        for s, step in enumerate(record["steps"]):
            check_layout(step, s, PROMPT + s, record, model.config)
        check_weights(model, record, kind)
        check_bound(record, model.config, kw["kv_cache"])
        if kind == "int8":  # K and V (inside K for MLA) of what each step wrote, a little off
            errors = torch.tensor([[e for e in group if e is not None] for s in record["steps"]
                                   for group in s["errors"]])
            assert ((errors > 0) & (errors < 0.02)).all()
        else:
            assert all(s["errors"] is None for s in record["steps"])


@pytest.mark.parametrize("name", ["learned positions", "window, sinks", "local/global, sinks, sink logit"])
def test_a_batchs_first_row_is_recorded_as_it_would_be_alone(name):
    # Left-padded first (its pad cells hold no token), or the longer row beside a padded one (a
    # refill pads it: the other row keeps more).
    model = MODELS[name]()
    torch.manual_seed(4)
    long = torch.randint(0, 37, (PROMPT,)).tolist()
    short = long[:10] + torch.randint(0, 37, (4,)).tolist()
    for kind in ("float32", "no cache", "chunks of 4"):  # (int8 lays its cells out as float32 does)
        kw = CACHES[kind] | dict(share_prefix=False)
        for prompt, other in ((short, long), (long, short)):
            tokens, record = recorded(model, prompt, other, **kw)
            assert record["tokens"] == prompt + tokens and len(tokens) == NEW, kind
            check_weights(model, record, kind)
    # Their shared first 10 tokens, computed once in a cache of their own: not the stream's to record.
    with pytest.raises(ValueError, match="rows share a prompt prefix.*share_prefix=False"):
        recorded(model, short, long[:20])


def test_the_recorder_leaves_the_model_as_it_was():
    model = tiny_model(n_kv_head=2)
    tokens, record = recorded(model, [1, 2, 3])
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert all(not b.attn.keep_weights and b.attn.weights is None for b in model.blocks)
    cache = record["cache"]
    # tiny: 2 layers x 2 (K, V) x 2 kv heads x 4 numbers x 4 bytes, for 15 positions (3 + 12 new)
    assert cache["bytes_per_token"] == 2 * 2 * 2 * 4 * 4 and cache["nbytes"] == 15 * 128
    assert [g["bytes"] for g in cache["groups"]] == [15 * 64] * 2 and cache["formula"].startswith("2 layers")


def test_weights_to_record_bounds_the_page():
    """Per new token, every head of every layer over the cells it reads: at most block_size (or the
    context) where a layer sees the whole block; a windowed layer's sinks and window with the cache;
    without it, the context each forward runs (all of it with sinks)."""
    config = tiny_model().config  # 2 layers x 4 heads, block 24
    assert weights_to_record(config, 30, 20) == weights_to_record(config, 30, 20, False) == 20 * 2 * 4 * 24
    assert weights_to_record(config, 4, 3) == 3 * 2 * 4 * 5  # (4 + 5 + 6 keys)
    endless = cache_kind_model(ENDLESS["window, sinks"]).config  # a ring: 2 sinks + 6
    assert weights_to_record(endless, 30, 20) == 20 * 2 * 4 * 8
    assert weights_to_record(endless, 30, 20, kv_cache=False) == sum(range(30, 50)) * 2 * 4
    mixed = cache_kind_model(BOUNDED["local/global"]).config  # SSL: 3 of 4 layers within 5
    assert weights_to_record(mixed, 30, 20) == 20 * 4 * (3 * 5 + 24)
    # A GPT-2-sized ring model (12 layers x 12 heads, window 256 + 4 sinks) inspects 100 tokens
    # after a 1,000-token prompt: 3.7M weights, where the whole context's would be 15.8M.
    ring = tiny_config(block_size=1024, n_layer=12, n_head=12, n_embd=48, pos_emb="rope", attn_window=256,
                       attn_sinks=4)
    assert weights_to_record(ring, 1000, 100) == 100 * 12 * 12 * 260 <= MAX_WEIGHTS
