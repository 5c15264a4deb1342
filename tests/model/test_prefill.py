"""model/prefill.py: every cache kind and every way of filling it (one shot, chunks, one token at
a time, batched rows, a prefix the rows share, refills, rings) gives the uncached tokens."""

import itertools

import pytest
import torch

from model.generation import generate
from tests.helpers import BOUNDED, ENDLESS, cache_kind_model, stream_logits, tiny_model

FILLS = {"one shot": {}, "chunks of 4": {"prefill_chunk": 4}, "one token at a time": {"prefill_chunk": 1}}


def prompts_sharing_a_prefix(lengths=(4, 11, 17), shared=3):
    torch.manual_seed(1)
    prefix = torch.randint(0, 37, (shared,))
    return [torch.cat([prefix, torch.randint(0, 37, (n - shared,))]) for n in lengths]


@pytest.mark.parametrize("prefill", FILLS.values(), ids=FILLS.keys())
@pytest.mark.parametrize("kind", [*ENDLESS, *BOUNDED])
def test_every_cache_kind_and_prefill_gives_the_uncached_tokens(kind, prefill):
    """Batched prompts of three lengths sharing a prefix (computed once; each row prefilling its own
    is held to the row alone below), each way of filling the cache: the tokens
    the uncached reference gives, sampled (one generator per row), drawn from its logits (to float32
    rounding: so greedy decoding, which reads only the logits, gives its tokens too), 2x past
    block_size (24) where the design generates past it (every ring wraps twice or more)."""
    sampling = {"temperature": 1.0, "top_k": 20}
    model = cache_kind_model(ENDLESS.get(kind) or BOUNDED[kind])
    prompts = prompts_sharing_a_prefix()
    n = 2 * 24 if kind in ENDLESS else 24 - 17
    (rows, logits), (rows_ref, logits_ref) = [
        stream_logits(model, prompts, n, kv_cache=kv, **sampling, **(prefill if kv else {}),
                      generator=[torch.Generator().manual_seed(row) for row in range(3)])
        for kv in (True, False)]
    assert [len(t) for t in rows] == [4 + n, 11 + n, 17 + n]
    assert all(torch.equal(a, b) for a, b in zip(rows, rows_ref))
    torch.testing.assert_close(torch.stack(logits), torch.stack(logits_ref), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
@pytest.mark.parametrize("kind", [*ENDLESS, *BOUNDED])
def test_every_batched_row_is_its_prompt_alone_in_every_cache_precision(kind, dtype):
    """Rows sharing a prefix, each way of filling the cache, the prefix computed once or per row:
    every row's tokens, and the logits each was drawn from, are those of its prompt decoded alone in
    a cache of that precision (int8 and bfloat16 round what they store, so a shared prefix must be
    computed as stored, as the row alone computes it), past the block where the design goes on.
    A CPU's float32 products are not batch-invariant: a row's numbers may differ in their last bit in a
    batch and alone, which bfloat16's 8-bit mantissa can round to a neighbouring stored value (MLA's
    logits 6e-6 apart on an AVX-512 AMD EPYC): its logits within 1e-4, the others' within 1e-6."""
    model = cache_kind_model(ENDLESS.get(kind) or BOUNDED[kind])
    prompts = prompts_sharing_a_prefix()
    n = 24 + 8 if kind in ENDLESS else 24 - 17
    atol = 1e-4 if dtype == torch.bfloat16 else 1e-6
    alone = [stream_logits(model, [prompt], n, kv_dtype=dtype) for prompt in prompts]
    for fill, share in itertools.product(FILLS.values(), (True, False)):
        rows, logits = stream_logits(model, prompts, n, kv_dtype=dtype, share_prefix=share, **fill)
        for r, (row_alone, logits_alone) in enumerate(alone):
            assert torch.equal(rows[r], row_alone[0]), (fill, share, r)
            torch.testing.assert_close(torch.stack([step[r] for step in logits]),
                                       torch.cat(logits_alone), atol=atol, rtol=0, msg=f"{fill} {share} {r}")


@pytest.mark.parametrize("kind", ["window, sinks", "local/global", "full"])
def test_num_samples_of_one_prompt_prefill_it_once(kind):
    """Eight rows of one prompt: one row is prefilled and copied into the others (the prefill runs
    one row, not eight), and each row draws what it draws when every row is prefilled."""
    model = cache_kind_model(ENDLESS.get(kind) or BOUNDED[kind])
    prompt = torch.randint(0, 37, (1, 10)).expand(8, 10)
    rows_run = []
    model.register_forward_pre_hook(lambda module, args: rows_run.append(args[0].shape))
    runs = [generate(model, prompt, 12, kv_cache=kv, share_prefix=share,
                     generator=[torch.Generator().manual_seed(row) for row in range(8)])
            for kv, share in ((True, True), (True, False), (False, False))]
    assert torch.equal(runs[0], runs[1]) and torch.equal(runs[0], runs[2])
    assert len({tuple(row[10:].tolist()) for row in runs[0]}) > 1    # the rows differ after the prompt
    assert rows_run[0] == (1, 10) and rows_run[1] == (8, 1)           # the prefill, then the first step
    assert rows_run[12] == (8, 10)                                    # without sharing: all eight


@pytest.mark.parametrize("kind", ["window, sinks", "gqa window, sinks, sink logit"])
def test_a_prompt_past_block_size_goes_into_a_ring_a_block_at_a_time(kind):
    """A sink model's next token depends on its whole prompt, however long. In one pass its
    attention would be T x (T + cells), a sink logit's bias so per head: ~26,000 characters took 23
    GB. It is prefilled block_size (24) tokens a pass, the tokens those of one pass (chunks are exact)
    and of the uncached reference."""
    model = cache_kind_model(ENDLESS[kind])
    prompt = torch.randint(0, 37, (1, 5 * 24 + 7), generator=torch.Generator().manual_seed(0))
    passes = []
    model.register_forward_pre_hook(lambda module, args: passes.append(args[0].size(1)))
    tokens = generate(model, prompt, 6, temperature=0)
    assert passes == [24] * 5 + [7] + [1] * 5  # the prompt, then the one-token steps
    for other in ({"prefill_chunk": 200}, {"prefill_chunk": 5}, {"kv_cache": False}):
        assert torch.equal(generate(model, prompt, 6, temperature=0, **other), tokens), other


LONG_PREFIX = ENDLESS | {"window = block": {"attn_window": 24}}  # 47 tokens of receptive field


@pytest.mark.parametrize("kind", LONG_PREFIX)
def test_rows_sharing_a_prefix_past_block_size_are_each_their_prompt_alone(kind):
    """A ring model's prompt of any length goes into its cache (sinks: all of it; no sinks: what is
    within its receptive field). Rows sharing a prefix longer than block_size (24): three samples of
    one 40-token prompt (the prefix, all of it, fed once; two of a 3-token one), or prompts of 41,
    44 and 46 tokens sharing their first 38 (each row's prefix at its own columns: a plain prefix
    holds block_size of it).
    Each row, in one pass or in chunks, draws what its prompt alone draws, from the same logits."""
    model = cache_kind_model(LONG_PREFIX[kind])
    prefix = prompts_sharing_a_prefix(lengths=(40,), shared=38)[0]
    # (and one shorter than the window: a ring writes from its sink cells on, past the prompt's length)
    sharing = prompts_sharing_a_prefix(lengths=(41, 44, 46), shared=38)
    for prompts in ([prefix] * 3, [prefix[:3]] * 2, sharing):
        alone = [stream_logits(model, [prompt], 6) for prompt in prompts]
        for fill in FILLS.values():
            rows, logits = stream_logits(model, prompts, 6, **fill)
            for r, (row_alone, logits_alone) in enumerate(alone):
                assert torch.equal(rows[r], row_alone[0]), (fill, r)
                torch.testing.assert_close(torch.stack([step[r % len(step)] for step in logits]),
                                           torch.cat(logits_alone), atol=1e-5, rtol=0)  # (a 1-row prefill)


def test_a_prefill_chunk_is_checked_once():
    with pytest.raises(ValueError, match="prefill_chunk must be an integer >= 1, got 0"):
        generate(tiny_model(), torch.zeros(1, 3, dtype=torch.long), 2, prefill_chunk=0)


def test_cached_path_past_block_size_refills_from_recent_tokens():
    """When the cache is full, the next logits come from the last block_size // 2 tokens."""
    model = tiny_model(block_size=8)
    idx = torch.randint(0, 37, (1, 8))
    out = generate(model, idx, 2, temperature=0, kv_cache=True)
    expected = model(out[:, 5:9])[:, -1].argmax(-1)  # 4 = 8 // 2 most recent tokens
    assert out[0, 9] == expected[0]
