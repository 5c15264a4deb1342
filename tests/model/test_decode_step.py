"""model/decode_step.py: one compiled or captured step and one static cache serve every call, with
the eager tokens, for every attention option; the SDPA kernels a decode may use, and never cuDNN."""

import contextlib
import copy
import dataclasses
import random

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from benchmarks.gpu import SDPACalls
from model import GPT
from model.decode_step import CompiledDecodeStep, decode_backends
from model.generation import generate
from model.kernels import SplitKV
from model.loading import load_model
from tests.helpers import ATTENTION, BOUNDED, ENDLESS, cache_kind_model, split_kv_wide, tiny_model


@pytest.mark.parametrize("attention", ["mha", "gqa", "mla"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_a_step_reading_the_written_cells_equals_one_reading_every_cell_masked(attention, dtype):
    """Eager steps attend over the positions written so far (no mask); the compiled step, whose
    shapes never change, over every cell with a mask. One computation."""
    model = tiny_model(pos_emb="rope", **ATTENTION[attention])
    cache = model.new_kv_cache(2, dtype=dtype)
    with torch.no_grad():
        model(torch.randint(0, 37, (2, 5)), kv_cache=cache)
        token, input_pos = torch.randint(0, 37, (2, 1)), torch.tensor([5])
        written = model.logits_at(token, input_pos, cache, cells_read=6)
        every_cell = model.logits_at(token, input_pos, cache, cells_read=None)
    torch.testing.assert_close(written, every_cell, atol=1e-6, rtol=0)


def test_one_compiled_step_and_one_static_cache_serve_every_call(tiny_ckpt):
    """Ten generate calls of different prompt lengths (padded and not), batch sizes and numbers
    of new tokens, past block_size (32) too: one graph, never recompiled, though on a CPU it reads
    the cells written so far (their number its dynamic size, the whole cache's too); the
    cache's buffers are the same ones throughout; the tokens are the eager step's, greedy and
    seeded. A second step (a window model's int8 ring, which reads every cell: static shapes) is a
    second graph, not a recompile. Both are traced by dynamo
    and AOTAutograd with no code generated (aot_eager: guards, recompiles and static buffers are
    dynamo's either way); inductor's code for the step, float32 and over an int8 cache, is
    test_quantize's, each compile there costing seconds."""
    from torch._dynamo.utils import counters

    model, _ = load_model(tiny_ckpt, "cpu")
    window = tiny_model(pos_emb="rope", attn_window=6, n_layer=1)  # (one layer: traced in half the time)
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
        assert (step.cells_read_carrier.shape == (model.config.block_size,)
                and other.cells_read_carrier is None)
        assert torch.equal(generate(window, [[1, 2]], 72, temperature=0, decode_step=other)[0], window_eager)
    assert counters["stats"]["unique_graphs"] - graphs == 2
    assert [t.data_ptr() for t in step.cache.buffers] == buffers
    with pytest.raises(ValueError, match="serves batches of up to 3 rows, got 4"):
        generate(model, [[1]] * 4, 2, decode_step=step)


@pytest.mark.parametrize("kind", ["gqa window, sinks, sink logit", "local/global, sinks, sink logit"])
def test_the_compiled_step_traces_sinks_and_local_global_layers(kind):
    """The step's one graph (aot_eager: dynamo and AOTAutograd trace it, with no code generated)
    over sinks beside int8 rings, learned sink logits and global layers: the eager step's tokens,
    past block_size (24) where the model generates past it. (The endless model has one layer: a
    second, another ring like it, would only double the seconds of tracing.)"""
    model = cache_kind_model(ENDLESS[kind] | {"n_layer": 1} if kind in ENDLESS else BOUNDED[kind])
    step = CompiledDecodeStep(model, batch_size=2, kv_dtype=torch.int8, backend="aot_eager")
    prompts, n = [[1, 2], [3, 4, 5, 6, 7]], 24 + 8 if kind in ENDLESS else 24 - 5
    eager, compiled = (generate(model, prompts, n, temperature=0, kv_dtype=torch.int8, decode_step=d)
                       for d in (None, step))
    assert [t.tolist() for t in compiled] == [t.tolist() for t in eager]


@pytest.mark.parametrize("block_size", [2, 3])
def test_a_compiled_step_whose_refill_empties_the_cache_gives_the_eager_tokens(block_size):
    """Blocks so short that a refill keeps no token (block_size // 2 - 1 = 0): the next step reads
    one cell, a size the step's graph was not compiled for and is not called with (it runs no guard
    that would catch it): the eager step's tokens, sampled and greedy, refilling many times over.
    (One layer: the refill is the cache's, whatever the layers.)"""
    model = tiny_model(block_size=block_size, n_layer=1)
    step = CompiledDecodeStep(model, batch_size=2, backend="aot_eager")
    for sampling in ({"temperature": 0}, {"temperature": 1.0}):
        eager, compiled = (generate(model, [[1, 2], [2, 3]], 12, decode_step=d, **sampling,
                                    generator=torch.Generator().manual_seed(0)) for d in (None, step))
        assert [t.tolist() for t in compiled] == [t.tolist() for t in eager], sampling


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
    """The static step's computation (every cell of the cache, masked, with each K/V head's query
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
    as many query heads as K/V heads, and one mask (the step's fixed shape reads every cell of the
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
