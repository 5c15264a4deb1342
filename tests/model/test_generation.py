"""model/generation.py: cached and uncached paths agree, sampling options, batched prompts,
generation past block_size, the compiled decode step."""

import contextlib
import copy
import dataclasses
import itertools
import random
import re

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.gpu import SDPACalls
from model import GPT
from model.attention import SplitKV
from model.decode_step import CompiledDecodeStep, decode_backends, int8_weights, step_package
from model.generation import generate, load_model, new_tokens_allowed, stream
from model.quantize import quantize_int8
from model.sampling import Sampling, sample_next
from tests.helpers import (
    ATTENTION,
    BOUNDED,
    ENDLESS,
    VARIANTS,
    cache_kind_model,
    split_kv_wide,
    stream_logits,
    tiny_model,
)
from training.evaluation import split_loss

FILLS = {"one shot": {}, "chunks of 4": {"prefill_chunk": 4}, "one token at a time": {"prefill_chunk": 1}}


def prompts_sharing_a_prefix(lengths=(4, 11, 17), shared=3):
    torch.manual_seed(1)
    prefix = torch.randint(0, 37, (shared,))
    return [torch.cat([prefix, torch.randint(0, 37, (n - shared,))]) for n in lengths]


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


def test_cached_path_past_block_size_refills_from_recent_tokens():
    """When the cache is full, the next logits come from the last block_size // 2 tokens."""
    model = tiny_model(block_size=8)
    idx = torch.randint(0, 37, (1, 8))
    out = generate(model, idx, 2, temperature=0, kv_cache=True)
    expected = model(out[:, 5:9])[:, -1].argmax(-1)  # 4 = 8 // 2 most recent tokens
    assert out[0, 9] == expected[0]


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


@pytest.mark.parametrize("attention", ["mha", "gqa", "mla"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_a_step_reading_the_written_slots_equals_one_reading_every_slot_masked(attention, dtype):
    """Eager steps attend over the positions written so far (no mask); the compiled step, whose
    shapes never change, over every slot with a mask. One computation."""
    model = tiny_model(pos_emb="rope", **ATTENTION[attention])
    cache = model.new_kv_cache(2, dtype=dtype)
    with torch.no_grad():
        model(torch.randint(0, 37, (2, 5)), kv_cache=cache)
        token, input_pos = torch.randint(0, 37, (2, 1)), torch.tensor([5])
        written = model.logits_at(token, input_pos, cache, cache_len=6)
        every_slot = model.logits_at(token, input_pos, cache, cache_len=None)
    torch.testing.assert_close(written, every_slot, atol=1e-6, rtol=0)


def test_streamed_tokens_are_plain_tensors_a_model_can_train_on():
    """The model decodes in inference mode; the tokens it yields are sampled outside it."""
    model = tiny_model()
    tokens = generate(model, torch.zeros(1, 1, dtype=torch.long), 8)
    assert not tokens.is_inference()
    model(tokens[:, :-1], tokens[:, 1:])[1].backward()  # an inference tensor could not be saved for it
    assert model.wte.weight.grad is not None


def test_top_k_one_is_greedy():
    logits = torch.randn(5, 37)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(sample_next(logits, Sampling(1, 1.0, top_k=1), generator=g), logits.argmax(-1))


def test_tiny_temperature_is_greedy():
    logits = torch.randn(5, 37)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(sample_next(logits, Sampling(1, 1e-6), generator=g), logits.argmax(-1))
    model = tiny_model()
    idx = torch.randint(0, 37, (2, 4))
    assert torch.equal(generate(model, idx, 10, temperature=1e-6, generator=g),
                       generate(model, idx, 10, temperature=0))


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    g = torch.Generator().manual_seed(0)
    draws = lambda p: {sample_next(logits, Sampling(1, 1.0, top_p=p), generator=g).item() for _ in range(300)}
    assert draws(0.5) == {0}          # 0.5 alone reaches 0.5
    assert draws(0.8) == {0, 1}       # 0.5 + 0.3 reaches 0.8
    assert draws(0.81) == {0, 1, 2}
    assert draws(1.0) == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="top_p"):  # checked once, when the Sampling is made
        Sampling(1, top_p=0)


@pytest.mark.parametrize("option,value,message", [
    ("max_new_tokens", -1, "max_new_tokens must be an integer >= 0"),
    ("temperature", -0.5, "temperature must be a number >= 0"),
    ("top_k", 0, "top_k must be an integer >= 1"),
    ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
])
def test_sampling_options_name_themselves(option, value, message):
    with pytest.raises(ValueError, match=message):
        Sampling(**{"max_new_tokens": 3, option: value})
    model = tiny_model()
    with pytest.raises(ValueError, match=message):
        generate(model, torch.zeros(1, 2, dtype=torch.long), **{"max_new_tokens": 3, option: value})


def test_one_compiled_step_and_one_static_cache_serve_every_call(tiny_ckpt):
    """Ten generate calls of different prompt lengths (padded and not), batch sizes and numbers
    of new tokens, past block_size (32) too: one graph, never recompiled, though on a CPU it reads
    the slots written so far (their number its dynamic size, the whole cache's too); the
    cache's buffers are the same ones throughout; the tokens are the eager step's, greedy and
    seeded. A second step (a window model's int8 ring, which reads every slot: static shapes) is a
    second graph, not a recompile. Both are traced by dynamo
    and AOTAutograd with no code generated (aot_eager: guards, recompiles and static buffers are
    dynamo's either way); inductor's code for the step, float32 and over an int8 cache, is
    test_quantize's, each compile there costing seconds."""
    from torch._dynamo.utils import counters

    model, _ = load_model(tiny_ckpt, "cpu")
    window = tiny_model(pos_emb="rope", attn_window=6)
    window_eager = generate(window, [[1, 2]], 72, temperature=0, kv_dtype=torch.int8)[0]
    graphs = counters["stats"]["unique_graphs"]  # dynamo's count since the process started
    step = CompiledDecodeStep(model, batch_size=3, backend="aot_eager")  # (traced when made)
    buffers = [t.data_ptr() for t in step.cache.buffers]
    rng = random.Random(0)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for call in range(10):
            prompts = [[rng.randrange(1, 60) for _ in range(rng.randint(1, 14))]
                       for _ in range(rng.randint(1, 3))]
            new = rng.choice([1, 5, 17, 45])
            kw = {"temperature": 0} if call % 2 else {"temperature": 0.9, "top_k": 20}
            eager, compiled = (generate(model, prompts, new, decode_step=decode_step, **kw, generator=[
                torch.Generator().manual_seed(call + row) for row in range(len(prompts))])
                for decode_step in (None, step))
            assert [t.tolist() for t in compiled] == [t.tolist() for t in eager], (call, prompts, new)
        # Another step (another model and cache) is a graph of its own, not a recompile of this one:
        # dynamo's recompile limit (8) does not bound how many steps of other shapes a process makes.
        # This one decodes a sliding window through an int8 ring, 3x past block_size (24).
        other = CompiledDecodeStep(window, batch_size=1, kv_dtype=torch.int8, backend="aot_eager")
        assert step.slots.shape == (model.config.block_size,) and other.slots is None
        assert torch.equal(generate(window, [[1, 2]], 72, temperature=0, decode_step=other)[0], window_eager)
    assert counters["stats"]["unique_graphs"] - graphs == 2
    assert [t.data_ptr() for t in step.cache.buffers] == buffers
    with pytest.raises(ValueError, match="serves batches of up to 3 rows, got 4"):
        generate(model, [[1]] * 4, 2, decode_step=step)


@pytest.mark.parametrize("kind", ["gqa window, sinks, sink logit", "local/global, sinks, sink logit"])
def test_the_compiled_step_traces_sinks_and_local_global_layers(kind):
    """The step's one graph (aot_eager: dynamo and AOTAutograd trace it, with no code generated)
    over sinks beside int8 rings, learned sink logits and global layers: the eager step's tokens,
    past block_size (24) where the model generates past it."""
    model = cache_kind_model(ENDLESS.get(kind) or BOUNDED[kind])
    step = CompiledDecodeStep(model, batch_size=2, kv_dtype=torch.int8, backend="aot_eager")
    prompts, n = [[1, 2], [3, 4, 5, 6, 7]], 24 + 8 if kind in ENDLESS else 24 - 5
    eager, compiled = (generate(model, prompts, n, temperature=0, kv_dtype=torch.int8, decode_step=d)
                       for d in (None, step))
    assert [t.tolist() for t in compiled] == [t.tolist() for t in eager]


@pytest.mark.parametrize("block_size", [2, 3])
def test_a_compiled_step_whose_refill_empties_the_cache_gives_the_eager_tokens(block_size):
    """Blocks so short that a refill keeps no token (block_size // 2 - 1 = 0): the next step reads
    one slot, a size the step's graph was not compiled for and is not called with (it runs no guard
    that would catch it): the eager step's tokens, sampled and greedy, refilling many times over."""
    model = tiny_model(block_size=block_size)
    step = CompiledDecodeStep(model, batch_size=2, backend="aot_eager")
    for sampling in ({"temperature": 0}, {"temperature": 1.0}):
        eager, compiled = (generate(model, [[1, 2], [2, 3]], 12, decode_step=d, **sampling,
                                    generator=torch.Generator().manual_seed(0)) for d in (None, step))
        assert [t.tolist() for t in compiled] == [t.tolist() for t in eager], sampling


def test_a_frozen_step_is_kept_under_its_weights_cache_and_folder(monkeypatch, tmp_path):
    """The CPU step of an int8 model is a package holding that model's weights (step_package): its
    file is the same for the same weights and cache (a later process loads it), another for any
    other weight, scale or bias, however small the difference, and for another cache's batch or
    dtype; it lives in inductor's cache folder, wherever TORCHINDUCTOR_CACHE_DIR puts it."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    model = quantize_int8(tiny_model(0))
    nudged = [copy.deepcopy(model) for _ in range(3)]
    nudged[0].blocks[1].mlp.fc.weight[3, 5] += 1                       # one int8 weight
    nudged[1].blocks[0].attn.qkv.scales[0] *= 1 + 2 ** -20             # one scale, its last bits
    nudged[2].norm_f.bias.data[0] += 1e-7
    paths = [step_package(m, m.new_kv_cache(1)) for m in
             [model, quantize_int8(tiny_model(0)), quantize_int8(tiny_model(1)), *nudged]]
    other_caches = model.new_kv_cache(2), model.new_kv_cache(1, dtype="int8")
    paths += [step_package(model, cache) for cache in other_caches]
    assert paths[0] == paths[1] and len(set(paths)) == 7
    assert all(path.parent == tmp_path / "kvgpt" for path in paths)
    assert int8_weights(model) and not int8_weights(tiny_model(0))


def test_the_decode_backends_never_hold_cudnn():
    """sdpa_kernel takes a list of SDPBackend members (the enum itself is not iterable). cuDNN, which
    builds a plan per exact shape, is never one; flash comes first (on a CPU, the compiled step's
    masked call too), math is the last resort."""
    for device in ("cpu", "cuda"):
        backends = decode_backends(torch.device(device))
        assert backends and all(isinstance(b, SDPBackend) for b in backends)
        assert SDPBackend.CUDNN_ATTENTION not in backends and backends[-1] == SDPBackend.MATH
        assert backends[0] == SDPBackend.FLASH_ATTENTION


class SDPACudnnFlags(SDPACalls):
    """SDPACalls that also keeps, per call, whether SDPA may pick cuDNN's attention then."""

    def __init__(self):
        super().__init__()
        self.cudnn = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.scaled_dot_product_attention:
            self.cudnn.append(torch.backends.cuda.cudnn_sdp_enabled())
        return super().__torch_function__(func, types, args, kwargs)


HOPPER_DEFAULT = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                  SDPBackend.MATH]  # PyTorch >= 2.9's order on an H100/H200: cuDNN first
DECODE_PATHS = {"one shot": {}, "prefill chunks": {"prefill_chunk": 3}, "batched, left-padded": {},
                "refills past block_size": {"max_new_tokens": 40}, "num_samples (a shared prefix)": {},
                "window ring": {}, "no cache": {"kv_cache": False}}


@pytest.mark.parametrize("path", DECODE_PATHS, ids=DECODE_PATHS.keys())
def test_no_sdpa_call_of_a_decode_may_run_cudnns_attention(path):
    """Where a GPU's default priority puts cuDNN first (which builds a plan per key length, ~50 ms
    each), no attention call a decode makes may pick it: prefill, chunks, padded rows, refills,
    shared prefixes, rings, and the uncached reference; the caller's setting comes back after."""
    model = tiny_model(pos_emb="rope", attn_window=5 if path == "window ring" else None)
    prompts = {"batched, left-padded": [[1, 2, 3, 4, 5], [6, 7]],
               "num_samples (a shared prefix)": [[1, 2, 3, 4]] * 3}.get(path, [[1, 2, 3, 4, 5]])
    options = {"max_new_tokens": 12} | DECODE_PATHS[path]
    with sdpa_kernel(HOPPER_DEFAULT, set_priority=True), SDPACudnnFlags() as calls:
        generate(model, prompts, options.pop("max_new_tokens"), temperature=1.0,
                 generator=torch.Generator().manual_seed(0), **options)
        assert torch.backends.cuda.cudnn_sdp_enabled()  # after it, the caller's setting again
    assert len(calls.cudnn) >= 12 * model.config.n_layer and not any(calls.cudnn)


DECODE_VARIANTS = {"mha": {}, "gqa": ATTENTION["gqa"], "mqa": ATTENTION["mqa"], "mla": ATTENTION["mla"],
                   "mqa_cla2": ATTENTION["mqa_cla2"], "gqa window": {"n_kv_head": 2, "attn_window": 4},
                   "gqa int8 cache": ATTENTION["gqa"],
                   "local/global, sinks, sink logit": BOUNDED["local/global, sinks, sink logit"]}


@pytest.mark.parametrize("split_kv", [False, True], ids=["sdpa", "split-kv"])
@pytest.mark.parametrize("variant", DECODE_VARIANTS, ids=DECODE_VARIANTS.keys())
def test_the_decode_steps_folded_heads_equal_the_naive_backend(variant, split_kv):
    """The static step's computation (every slot of the cache, masked, with each K/V head's query
    heads folded into its queries, through SDPA under the step's backend list, or as the CUDA step
    runs it, split-KV attention: FlexAttention, whose CPU reference this runs, on heads it takes)
    against the naive backend (scores broadcast over each group, no SDPA) reading the same cache:
    float32 logits within 1e-6 at every step, ring wraps included, and the same greedy tokens. (An
    int8 cache's step reads it as stored either way.)"""
    overrides = DECODE_VARIANTS[variant]
    model = cache_kind_model(split_kv_wide(overrides) if split_kv else overrides)
    naive = GPT(dataclasses.replace(model.config, attn_backend="naive")).eval()
    naive.load_state_dict(model.state_dict())
    cache = model.new_kv_cache(2, dtype=torch.int8 if "int8" in variant else None)
    token, pad = torch.tensor([[3], [4]]), torch.zeros(2, dtype=torch.long)
    with torch.no_grad():
        model(torch.randint(0, 37, (2, 5), generator=torch.Generator().manual_seed(0)), kv_cache=cache)
        for _ in range(8 if split_kv else 15):  # (FlexAttention's CPU reference is slow; 8 wrap the rings)
            input_pos, same_cache = torch.tensor([cache.length]), copy.deepcopy(cache)
            with sdpa_kernel(decode_backends(torch.device("cpu")), set_priority=True), SDPACalls() as calls, \
                    SplitKV() if split_kv else contextlib.nullcontext():
                logits = model.logits_at(token, input_pos, cache, pad)[:, -1]           # (2, vocab)
            assert not (split_kv and calls.made)  # (every attention call split-KV)
            reference = naive.logits_at(token, input_pos, same_cache, pad)[:, -1]
            torch.testing.assert_close(logits, reference, atol=1e-6, rtol=0)
            assert torch.equal(logits.argmax(-1), reference.argmax(-1))
            cache.advance(1)
            token = logits.argmax(-1, keepdim=True)                                     # (2, 1)


@pytest.mark.parametrize("variant", DECODE_VARIANTS, ids=DECODE_VARIANTS.keys())
def test_every_sdpa_call_of_the_decode_step_is_mha_shaped(variant):
    """What the CUDA kernels need (PyTorch 2.11): no call of the step passes enable_gqa, each has
    as many query heads as K/V heads, and one mask (the step's fixed shape reads every slot of the
    layer's cache, and a learned sink is one key more)."""
    model = tiny_model(pos_emb="rope", **DECODE_VARIANTS[variant])
    sink_key = int(model.config.attn_sink_logit)
    cache = model.new_kv_cache(2)
    cache.advance(3)
    with torch.no_grad(), SDPACalls() as calls:
        model.logits_at(torch.tensor([[3], [4]]), torch.tensor([3]), cache, torch.zeros(2, dtype=torch.long))
    assert len(calls.made) == model.config.n_layer  # every layer attends, sharing ones too
    for q, k, v, kwargs in calls.made:
        assert not kwargs.get("enable_gqa") and q.size(1) == k.size(1) == v.size(1)
        assert kwargs["attn_mask"] is not None and kwargs["attn_mask"].size(-1) == k.size(2)
        assert k.size(2) in {group.cells + sink_key for group in cache.groups}


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


@pytest.mark.parametrize("temperature", [1e-30, 1e-40, 1e-46, 5e-324])
def test_a_temperature_however_small_samples_the_most_likely_token(temperature):
    """logits / temperature would overflow to inf, and inf - inf is NaN: no temperature > 0 may."""
    logits = torch.randn(4, 37) * 10
    generator = torch.Generator().manual_seed(0)
    assert torch.equal(sample_next(logits, Sampling(1, temperature), generator=generator), logits.argmax(-1))
    model = tiny_model()
    idx = torch.randint(0, 37, (2, 3))
    assert torch.equal(generate(model, idx, 6, temperature=temperature, generator=generator),
                       generate(model, idx, 6, temperature=0))


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


def test_split_loss_checks_its_arguments_and_batches_as_asked():
    model = tiny_model()
    tokens = torch.randint(0, 37, (200,))
    widths = []
    hook = model.register_forward_pre_hook(lambda module, args: widths.append(args[0].size(0)))
    losses = [split_loss(model, tokens, windows_per_batch=n) for n in (1, 3, 64)]
    hook.remove()
    assert widths == [1] * 9 + [3] * 3 + [9]  # 199 targets: 9 windows of 24, at most n per forward
    assert losses == pytest.approx([losses[0]] * 3, abs=1e-6)
    for bad, message in [({"tokens": tokens.float()}, "tokens must be a 1-D split of 2 token ids"),
                         ({"windows_per_batch": 0}, "windows_per_batch must be an integer >= 1"),
                         ({"kv_dtype": torch.int32}, "kv_dtype must be one of")]:
        with pytest.raises(ValueError, match=message):
            split_loss(model, **({"tokens": tokens} | bad))


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


@pytest.mark.parametrize("kind", ["window, sinks", "gqa window, sinks, sink logit"])
def test_a_prompt_past_block_size_goes_into_a_ring_a_block_at_a_time(kind):
    """A sink model's next token depends on its whole prompt, however long. In one pass its
    attention would be T x (T + slots), a sink logit's bias so per head: ~26,000 characters took 23
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


def test_a_prefill_chunk_is_checked_once():
    with pytest.raises(ValueError, match="prefill_chunk must be an integer >= 1, got 0"):
        generate(tiny_model(), torch.zeros(1, 3, dtype=torch.long), 2, prefill_chunk=0)


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
