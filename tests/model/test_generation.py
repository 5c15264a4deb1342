"""model/generation.py: the cached stream equals the uncached reference for every attention option,
batched prompts each as alone, generation past block_size, and every argument checked once."""

import random
import re

import pytest
import torch

from model.decode_step import CompiledDecodeStep
from model.generation import generate, new_tokens_allowed, stream
from model.sampling import Sampling
from tests.helpers import ATTENTION, VARIANTS, cache_kind_model, stream_logits, tiny_model


@pytest.mark.parametrize("attention", ATTENTION.values(), ids=ATTENTION.keys())
@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_greedy_cache_equals_no_cache(attention, pos_emb):
    """For MLA this is the absorbed form (cache) against the plain form (no cache)."""
    model = tiny_model(pos_emb=pos_emb, **attention)
    idx = torch.randint(0, 37, (3, 6))
    cached = generate(model, idx, 18, temperature=0, kv_cache=True)   # 24 = block_size
    uncached = generate(model, idx, 18, temperature=0, kv_cache=False)
    assert cached.shape == (3, 24) and torch.equal(cached, uncached)
    assert torch.equal(cached[:, :6], idx)


@pytest.mark.parametrize("attention", ATTENTION.values(), ids=ATTENTION.keys())
def test_a_window_model_generates_past_block_size_cached_as_uncached(attention):
    """A sliding window with RoPE: 3x block_size (24) and more, prompts of different lengths
    batched, sampled with a generator per row; the reference recomputes the whole sequence under the
    window mask at every step."""
    model = tiny_model(pos_emb="rope", attn_window=6, **attention)
    prompts = [torch.randint(0, 37, (n,)) for n in (3, 9)]
    runs = [generate(model, prompts, 3 * 24, kv_cache=kv, top_k=20,
                           generator=[torch.Generator().manual_seed(row) for row in range(2)])
            for kv in (True, False)]
    assert [len(t) for t in runs[0]] == [3 + 72, 9 + 72]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_learned_positions_end_generation_with_a_window_at_block_size():
    model = tiny_model(attn_window=6)
    assert generate(model, torch.zeros(1, 4, dtype=torch.long), 20, temperature=0).shape == (1, 24)
    with pytest.raises(ValueError, match=r"exceed block_size=24: a sliding-window model \(attn_window\) "
                                         r"with learned positions generates at most max_new_tokens=20"):
        generate(model, torch.zeros(1, 4, dtype=torch.long), 21, temperature=0)


@pytest.mark.parametrize("n_kv_head", VARIANTS.values(), ids=VARIANTS.keys())
def test_seeded_sampling_cache_equals_no_cache(n_kv_head):
    model = tiny_model(n_kv_head=n_kv_head)
    idx = torch.randint(0, 37, (2, 4))
    runs = [generate(model, idx, 20, temperature=1.0, top_k=20, top_p=0.9, kv_cache=kv,
                           generator=torch.Generator().manual_seed(5)) for kv in (True, False)]
    assert torch.equal(*runs)
    other = generate(model, idx, 20, generator=torch.Generator().manual_seed(6))
    assert not torch.equal(runs[0], other)


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize("kv_cache", [True, False])
def test_generation_goes_past_block_size(pos_emb, kv_cache):
    model = tiny_model(pos_emb=pos_emb, block_size=8)
    out = generate(model, torch.randint(0, 37, (2, 5)), 30, temperature=0, kv_cache=kv_cache)
    assert out.shape == (2, 35)
    # within block_size both paths agree; after it each keeps its documented scheme
    ref = generate(model, out[:, :5], 3, temperature=0, kv_cache=not kv_cache)
    assert torch.equal(out[:, :8], ref)


@pytest.mark.parametrize("attention", ATTENTION.keys())
@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
def test_each_row_of_a_batch_is_generated_as_it_would_be_alone(attention, pos_emb):
    """Random batch sizes, prompt lengths (some past block_size) and max_new_tokens (most past the
    cache's length, so rows refill at different steps); cached and uncached, sampled with one
    generator per row (more sensitive than greedy decoding to any difference of the logits)."""
    model = tiny_model(pos_emb=pos_emb, block_size=8, **ATTENTION[attention])
    rng = random.Random(f"{attention} {pos_emb}")
    for _ in range(2):
        prompts = [[rng.randrange(37) for _ in range(rng.randint(1, 12))] for _ in range(rng.randint(2, 4))]
        new = rng.randint(1, 24)
        seeds = range(len(prompts))
        for kv_cache in (True, False):
            batched = generate(model, prompts, new, kv_cache=kv_cache,
                               generator=[torch.Generator().manual_seed(s) for s in seeds])
            for prompt, row, seed in zip(prompts, batched, seeds):
                alone = generate(model, torch.tensor([prompt]), new, kv_cache=kv_cache,
                                 generator=torch.Generator().manual_seed(seed))[0]
                assert torch.equal(row, alone), (prompts, new, kv_cache)


def test_sampling_draws_only_ids_below_vocab_size():
    model = tiny_model()
    out = generate(model, torch.zeros(3, 1, dtype=torch.long), 40, temperature=5.0, vocab_size=4,
                         generator=torch.Generator().manual_seed(0))
    assert out[:, 1:].max() < 4 and len(out[:, 1:].unique()) == 4


def test_a_list_of_generators_needs_one_per_row():
    with pytest.raises(ValueError, match="one per row, 2; got 1"):
        generate(tiny_model(), [[1], [2, 3]], 3, generator=[torch.Generator()])


def test_a_list_of_equal_length_prompts_gives_a_list():
    model = tiny_model()
    out = generate(model, [[1, 2], [3, 4]], 3, temperature=0)
    assert [row.tolist()[:2] for row in out] == [[1, 2], [3, 4]] and [len(row) for row in out] == [5, 5]
    assert torch.equal(torch.stack(out), generate(model, torch.tensor([[1, 2], [3, 4]]), 3, temperature=0))


def test_streamed_tokens_are_plain_tensors_a_model_can_train_on():
    """The model decodes in inference mode; the tokens it yields are sampled outside it."""
    model = tiny_model()
    tokens = generate(model, torch.zeros(1, 1, dtype=torch.long), 8)
    assert not tokens.is_inference()
    model(tokens[:, :-1], tokens[:, 1:])[1].backward()  # an inference tensor could not be saved for it
    assert model.wte.weight.grad is not None


# Every argument of the public generation API, checked once per call with an error naming it.
# (argument, a bad value, the words of its error); the model is tiny_model (vocab 37, block 24).
BAD_ARGUMENTS = [
    ("kv_dtype", torch.int32, "kv_dtype must be one of float32, bfloat16, int8"),
    *[("kv_dtype", dtype, "kv_dtype must be one of") for dtype in
      (torch.int16, torch.uint8, torch.bool, torch.float16, "int4")],
    ("idx", torch.zeros(2, 3), "idx must be a (B, T) tensor of token ids with T >= 1, got torch.float32"),
    ("idx", torch.zeros(3, dtype=torch.long), "idx must be a (B, T) tensor"),
    ("idx", torch.zeros(1, 0, dtype=torch.long), "idx must be a (B, T) tensor of token ids with T >= 1"),
    ("idx", torch.full((1, 2), 37), "idx: token ids must be in 0..36"),
    ("idx", torch.full((1, 2), -1), "idx: token ids must be in 0..36"),
    ("max_new_tokens", -1, "max_new_tokens must be an integer >= 0"),
    ("max_new_tokens", 2.5, "max_new_tokens must be an integer"),
    ("max_new_tokens", True, "max_new_tokens must be an integer"),
    ("max_new_tokens", 2**63, "max_new_tokens must be at most"),
    ("temperature", float("nan"), "temperature must be a number >= 0 and finite"),
    ("temperature", float("inf"), "temperature must be"), ("temperature", "hot", "temperature must be"),
    ("top_k", 0, "top_k must be an integer >= 1"), ("top_k", 1.5, "top_k must be an integer"),
    ("top_p", 0.0, "top_p must be in (0, 1]"), ("top_p", float("nan"), "top_p must be in"),
    ("generator", "seed", "generator must be a torch.Generator"),
    ("generator", [torch.Generator()] * 3, "one per row, 2; got 3"),
    ("vocab_size", 0, "vocab_size must be an integer >= 1"),
    ("vocab_size", 38, "vocab_size must be at most 37"),
    ("decode_step", object(), "decode_step must be a CompiledDecodeStep built for this model"),
]


@pytest.mark.parametrize("argument,value,message", BAD_ARGUMENTS,
                         ids=[f"{a}={v!r:.20}" for a, v, _ in BAD_ARGUMENTS])
def test_every_argument_of_generate_is_checked_and_named(argument, value, message):
    model = tiny_model()
    kwargs = {"idx": torch.zeros(2, 3, dtype=torch.long), "max_new_tokens": 3} | {argument: value}
    with pytest.raises(ValueError, match=re.escape(message)):
        generate(model, **kwargs)


def test_a_cache_stores_only_its_dtypes_given_by_dtype_or_name():
    model = tiny_model()
    idx = torch.randint(0, 37, (2, 5))
    assert torch.equal(generate(model, idx, 8, temperature=0, kv_dtype="int8"),
                       generate(model, idx, 8, temperature=0, kv_dtype=torch.int8))
    for bad, message in [({"batch_size": 0}, "batch_size must be an integer >= 1"),
                         ({"batch_size": 1, "max_len": 25}, "max_len must be at most 24"),
                         ({"batch_size": 1, "dtype": torch.int64}, "dtype must be one of float32")]:
        with pytest.raises(ValueError, match=message):
            model.new_kv_cache(**bad)
    float32_step = CompiledDecodeStep(model, batch_size=2, backend="aot_eager")
    with pytest.raises(ValueError, match="built for this model"):  # another model's step
        generate(tiny_model(seed=1), idx, 2, decode_step=float32_step)
    with pytest.raises(ValueError, match="kv_dtype=torch.int8, but the decode step.s cache stores"):
        generate(model, idx, 2, decode_step=float32_step, kv_dtype="int8")
    with pytest.raises(ValueError, match="cuda_graph on CUDA"):  # a CUDA graph of a model on the CPU
        CompiledDecodeStep(model, backend="cuda_graph")


@pytest.mark.parametrize("attention", ["mha", "mla", "gqa_cla2_3_layers"])
def test_a_window_model_runs_only_what_its_layers_can_see(attention):
    """A sliding window of 6 over n_layer layers: the next token depends on the last n_layer x 5
    + 1 tokens. Prompts far longer than that (and than block_size) prefill only those, at the
    positions they have in the whole sequence: the logits are the whole context's; cached equals
    uncached, batched rows their prompts alone; no forward ever runs more positions."""
    model = tiny_model(pos_emb="rope", attn_window=6, **ATTENTION[attention])
    reach = model.config.receptive_field
    assert reach == model.config.n_layer * 5 + 1
    widths = []
    hook = model.register_forward_pre_hook(lambda module, args: widths.append(args[0].size(1)))
    prompts = [torch.randint(0, 37, (n,)) for n in (300, 7, 61)]
    runs = [generate(model, prompts, 40, kv_cache=kv, temperature=1.0, top_k=20,
                           generator=[torch.Generator().manual_seed(row) for row in range(3)])
            for kv in (True, False)]
    hook.remove()
    assert max(widths) == reach
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    for row, prompt in enumerate(prompts):
        alone = generate(model, prompt[None], 40, temperature=1.0, top_k=20,
                               generator=torch.Generator().manual_seed(row))[0]
        assert torch.equal(runs[0][row], alone)
    with torch.no_grad():
        whole = model(prompts[0][None])[:, -1]
    cut = generate(model, prompts[0][None], 1, temperature=0)[0, -1]
    assert cut == whole.argmax(-1)[0]


def test_memory_does_not_grow_with_max_new_tokens():
    """Tokens are kept only as far back as any step reads: asking for 2**62 allocates nothing more,
    and the first tokens come at once."""
    model = tiny_model()
    tokens = stream(model, torch.zeros(1, 2, dtype=torch.long), Sampling(2**62, temperature=0))
    first = [next(tokens) for _ in range(60)]  # 2.5x block_size: the buffer moved its last 24 forward
    reference = generate(model, torch.zeros(1, 2, dtype=torch.long), 60, temperature=0)[0, 2:]
    assert torch.equal(torch.cat(first), reference)


def test_a_sink_model_generates_ten_times_past_block_size_at_constant_cache_bytes():
    """StreamingLLM: the first attn_sinks positions stay visible beside a ring of the window, so the
    cache is sinks + window positions however long the sequence; the tokens are the reference's."""
    model = cache_kind_model({"attn_window": 6, "attn_sinks": 2})
    cache = model.new_kv_cache(1)
    assert cache.ring and cache.max_len == 8 and cache.nbytes == model.new_kv_cache(1, 8).nbytes
    assert model.config.max_positions is None and model.config.receptive_field is None
    idx = torch.randint(0, 37, (1, 5))
    runs = [generate(model, idx, 10 * 24, temperature=0, kv_cache=kv) for kv in (True, False)]
    assert runs[0].shape == (1, 245) and torch.equal(*runs)


# How far a batched row's logits may be from its prompt's alone: float32's rounding; in a cache that
# rounds what it stores, the one step of its rounding that float32's can tip a stored number over.
ROUNDING = {torch.float32: 1e-6, torch.bfloat16: 1e-4, torch.int8: 1e-4}


def random_cache_case(rng: random.Random) -> tuple[dict, list, dict, int]:
    """A random model of every option a cache depends on (attention kind, sharing, windows up to
    block_size, a layer pattern, both sinks, positions), prompts that may share a prefix, a way to
    fill the cache, its precision and a count of new tokens: (overrides, prompts, kwargs, n)."""
    block = rng.randint(6, 12)
    overrides = {"block_size": block, "n_layer": rng.randint(1, 3),
                 "pos_emb": rng.choice(["rope", "rope", "rope", "learned"])}
    overrides |= rng.choice([{}, {"n_kv_head": 2}, {"n_kv_head": 1}, ATTENTION["mla"]])
    overrides["kv_share"] = rng.randint(1, overrides["n_layer"])
    if rng.random() < 0.8:
        overrides |= {"attn_window": rng.choice([1, 2, block // 2, block - 1, block]),
                      "attn_sinks": rng.choice([0, 0, 1, 3]), "attn_sink_logit": rng.random() < 0.3}
        if rng.random() < 0.4 and overrides["kv_share"] == 1:
            pattern = rng.choice(["SL", "LS", "SSL"])[:overrides["n_layer"]]
            overrides["window_pattern"] = pattern if "S" in pattern else "S"
    prefix = [rng.randrange(37) for _ in range(rng.randint(0, 3))]
    prompts = [prefix + [rng.randrange(37) for _ in range(rng.randint(1, block // 2))]
               for _ in range(rng.choice([1, 2, 3, 3]))]
    kwargs = {"prefill_chunk": rng.choice([None, 1, 3]), "share_prefix": rng.random() < 0.7,
              "kv_dtype": rng.choice([torch.float32, torch.bfloat16, torch.int8]),
              "temperature": rng.choice([0, 1.0]), "top_k": rng.choice([None, 10])}
    return overrides, prompts, kwargs, rng.randint(1, 3 * block)


@pytest.mark.parametrize("seed", range(16))
def test_random_models_decode_each_row_as_alone_and_as_the_uncached_reference(seed):
    """A randomized differential test: each batched cached row (tokens and the logits they were drawn
    from) equals its prompt decoded alone in a cache of the same precision, and in float32, within
    what the reference computes the same way (the whole sequence where the design is endless, else
    block_size), equals the uncached reference."""
    overrides, prompts, kwargs, n = random_cache_case(random.Random(seed))
    model = cache_kind_model(overrides)
    longest = max(len(p) for p in prompts)
    n = int(min(n, new_tokens_allowed(model.config, longest)))
    if n == 0:
        return
    def generators():
        return [torch.Generator().manual_seed(r) for r in range(len(prompts))]

    rows, logits = stream_logits(model, prompts, n, **kwargs, generator=generators())
    for r, prompt in enumerate(prompts):
        alone, alone_logits = stream_logits(model, [prompt], n, **kwargs | {"share_prefix": True},
                                            generator=[torch.Generator().manual_seed(r)])
        assert torch.equal(rows[r], alone[0]), (overrides, prompts, kwargs, r)
        torch.testing.assert_close(torch.stack([step[r] for step in logits]), torch.cat(alone_logits),
                                   atol=ROUNDING[kwargs["kv_dtype"]], rtol=0, msg=f"{overrides} {kwargs}")
    if kwargs["kv_dtype"] != torch.float32:
        return
    within = n if model.config.max_positions is None else min(n, model.config.block_size - longest)
    if within > 0:
        ref, ref_logits = stream_logits(model, prompts, within, kv_cache=False, generator=generators(),
                                        temperature=kwargs["temperature"], top_k=kwargs["top_k"])
        for row, row_ref in zip(rows, ref):
            assert torch.equal(row[:len(row_ref)], row_ref), (overrides, prompts, kwargs)
        torch.testing.assert_close(torch.stack(logits[:within]), torch.stack(ref_logits), atol=1e-5, rtol=0)


def test_no_new_tokens_draw_nothing():
    """max_new_tokens=0 returns the prompt and leaves the generator where it was (no draw)."""
    generator = torch.Generator().manual_seed(0)
    state = generator.get_state()
    out = generate(tiny_model(), torch.tensor([[1, 2]]), 0, generator=generator)
    assert torch.equal(out, torch.tensor([[1, 2]])) and torch.equal(generator.get_state(), state)


@pytest.mark.parametrize("how", ["cached", "uncached", "compiled"])
def test_each_row_ends_at_its_first_end_of_text_id_as_it_would_alone(how):
    """Rows sampled with a generator each, left-padded prompts: with eos_ids, each row's tokens are
    those it draws without them up to its first eos id, then that id again; the stream ends once
    every row has drawn one; generate's list form cuts each row after its eos id."""
    model = tiny_model(pos_emb="rope", block_size=64)
    prompts, new = [[1, 2, 3], [4, 5], [6, 7, 8, 9]], 30
    options = {"kv_cache": how != "uncached"}
    if how == "compiled":
        options["decode_step"] = CompiledDecodeStep(model, batch_size=3, backend="aot_eager", max_len=64)
    seeds = lambda: [torch.Generator().manual_seed(s) for s in range(3)]  # noqa: E731
    free = generate(model, prompts, new, temperature=1.0, generator=seeds(), **options)
    news = [row[len(p):].tolist() for row, p in zip(free, prompts)]
    eos = [news[0][4], news[1][9]]  # (row 0 ends by its 5th token at the latest, row 1 by its 10th)
    ended = generate(model, prompts, new, temperature=1.0, eos_ids=eos, generator=seeds(), **options)
    ends = [next((i + 1 for i, t in enumerate(row) if t in eos), new) for row in news]
    for prompt, row, alone, end in zip(prompts, ended, news, ends):
        assert row[len(prompt):].tolist() == alone[:end]
    idx = torch.tensor([[0, 1, 2, 3], [0, 0, 4, 5], [6, 7, 8, 9]])
    tokens = list(stream(model, idx, Sampling(new, 1.0, eos_ids=eos), pad=torch.tensor([1, 2, 0]),
                         generator=seeds()) if how == "cached" else [])
    if tokens:
        assert len(tokens) == max(ends)
        for row, end in enumerate(ends):
            assert [int(t[row]) for t in tokens[end - 1:]] == [news[row][end - 1]] * (len(tokens) - end + 1)


def test_a_row_that_draws_no_end_of_text_id_runs_to_max_new_tokens():
    model = tiny_model()
    free = generate(model, torch.tensor([[1, 2]]), 12, temperature=0)
    unused = next(i for i in range(37) if i not in free[0, 2:].tolist())
    assert torch.equal(generate(model, torch.tensor([[1, 2]]), 12, temperature=0, eos_ids=unused), free)
