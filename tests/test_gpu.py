"""The CUDA checks, run with `pytest --gpu tests/test_gpu.py` (the GPU plan's last command; without
--gpu they are skipped and the suite hides CUDA): the decode step gets a fused SDPA kernel for every
attention variant, the static step (a CUDA graph, or compiled) gives the eager step's tokens and the
uncached path's logits, the training step gets flash and as a CUDA graph trains as run as written,
a run with it resumes and samples with no warning in the text, a model decoding on CUDA has its
head's rows padded and the unpadded head's tokens, a torchrun job with more processes
than GPUs is refused in one line, MFU's peak is read from the GPU's name, and BatchedMuon steps as
PyTorch's Muon."""

import copy
import dataclasses
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention import sdpa_kernel

from benchmarks.gpu import VARIANTS, SDPACalls, decode_step_kernels, training_kernels, variant_model
from data.batches import Batches
from model import GPT, GPTConfig
from model.decode_step import CompiledDecodeStep, decode_backends
from model.device import Precision
from model.generation import generate
from model.kernels import SplitKV
from model.loading import for_decoding
from model.sampling import draw
from tests.helpers import ROOT, clean_env, compose, split_kv_wide, tiny_model, train_checked
from tests.model.test_decode_step import DECODE_VARIANTS
from training.optimizer import BatchedMuon, configure_optimizer
from training.step import TrainStep
from training.throughput import PEAK_BF16_TFLOPS, Throughput, peak_tflops

pytestmark = pytest.mark.gpu  # (conftest: run with --gpu only, on a machine with CUDA)
CUDA = torch.device("cuda")


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANTS.keys())
def test_the_decode_step_gets_a_fused_sdpa_kernel_for_every_variant(variant):
    """GPT-2 small width in bf16, batch 1 and 64: no attention call of the step falls back to math."""
    model = variant_model(VARIANTS[variant], CUDA, torch.bfloat16, smoke=False)
    for batch in (1, 64):
        kernels = decode_step_kernels(model, batch)
        assert len(kernels) == 12 and not {"math", "none"} & set(kernels), (batch, kernels)


def test_the_recipes_training_step_gets_flash():
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=65, block_size=256, n_layer=6, n_head=6, n_embd=384)).to(CUDA)
    assert set(training_kernels(model.to(torch.bfloat16), 4)) == {"flash"}


@pytest.fixture
def float32_matmuls():
    """float32 matmuls as float32 (no TF32) for the test."""
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(precision)


INDUCTOR = ["mqa", "gqa int8 cache"]  # (an inductor compile each: the rest run the CUDA-graph step)


@pytest.mark.parametrize("backend", ["cuda_graph", "inductor"])
@pytest.mark.parametrize("variant", DECODE_VARIANTS, ids=DECODE_VARIANTS.keys())
def test_the_static_step_on_cuda_gives_the_eager_tokens_and_the_uncached_logits(variant, backend,
                                                                                  float32_matmuls):
    """float32, greedy and seeded, two calls with prompts of two lengths. The static step (captured
    as a CUDA graph, or compiled, both with split-KV attention over a mask and the token drawn
    inside the graph) gives the eager step's tokens, seeded too. The uncached reference runs other kernels
    (the whole context at once: flash or math), so it agrees to float rounding: the same greedy
    tokens, and along the sampled tokens logits within 1e-5; a seeded draw may part where its uniform
    falls within that rounding of a boundary (benchmarks/gpu.py --section exactness shows where)."""
    if backend == "inductor" and variant not in INDUCTOR:
        pytest.skip("compiled with inductor for " + ", ".join(INDUCTOR) + " only (seconds each)")
    model = tiny_model(pos_emb="rope", **split_kv_wide(DECODE_VARIANTS[variant])).to(CUDA)
    kv_dtype = torch.int8 if "int8" in variant else None
    step = CompiledDecodeStep(model, kv_dtype=kv_dtype, backend=backend, split_kv=True)
    for kw in ({"temperature": 0}, {"temperature": 1.0, "top_k": 20}):
        for length in (1, 7):
            prompt = torch.arange(1, length + 1, device=CUDA)[None]          # (1, length)
            generator = lambda: torch.Generator(CUDA).manual_seed(length)  # noqa: B023
            outs = [generate(model, prompt, 30, kv_cache=cache, decode_step=decode_step,
                             kv_dtype=kv_dtype, generator=generator(), **kw)
                    for cache, decode_step in ((True, step), (True, None), (False, None))]
            assert torch.equal(outs[0], outs[1]), (kw, length, "static vs eager step")
            if kv_dtype is not None:  # an int8 cache rounds what the uncached path keeps exact
                continue
            if kw["temperature"] == 0:
                assert torch.equal(outs[0], outs[2]), (length, "greedy: cached vs uncached")
            assert_cached_logits_close(model, outs[0], length)


def test_draw_gives_torch_multinomials_tokens_on_cuda():
    """The step's draw inside a CUDA graph (no host check) is torch.multinomial's, bit for bit."""
    for seed in range(60):
        rows, vocab = [(1, 65), (4, 50257), (3, 7)][seed % 3]
        logits = torch.randn(rows, vocab, device=CUDA, generator=torch.Generator(CUDA).manual_seed(seed)) * 3
        probs = torch.softmax(logits.masked_fill(logits < 0, float("-inf")) if seed % 2 else logits, -1)
        expected = torch.multinomial(probs, 1, generator=torch.Generator(CUDA).manual_seed(seed)).squeeze(1)
        assert torch.equal(draw(probs, torch.Generator(CUDA).manual_seed(seed)), expected), seed


@pytest.mark.parametrize("variant", DECODE_VARIANTS, ids=DECODE_VARIANTS.keys())
def test_split_kv_attention_on_cuda_equals_the_naive_backend(variant, float32_matmuls):
    """The CUDA step's computation with split-KV attention (FlexAttention's decoding kernel,
    compiled) against the naive backend over the same cache, float32, 12 steps from a 5-token
    prompt (a window's ring wraps): logits within 1e-5 and the same greedy tokens; no SDPA call
    (an int8 cache's one-query kernel reads it as stored instead)."""
    model = tiny_model(pos_emb="rope", **split_kv_wide(DECODE_VARIANTS[variant])).to(CUDA).eval()
    naive = GPT(dataclasses.replace(model.config, attn_backend="naive")).to(CUDA).eval()
    naive.load_state_dict(model.state_dict())
    cache = model.new_kv_cache(2, dtype=torch.int8 if "int8" in variant else None)
    token, pad = torch.tensor([[3], [4]], device=CUDA), torch.tensor([0, 2], device=CUDA)
    with torch.no_grad():
        model(torch.randint(1, 37, (2, 5), device=CUDA), kv_cache=cache, starts=pad)
        for _ in range(12):
            input_pos, same_cache = torch.tensor([cache.length], device=CUDA), copy.deepcopy(cache)
            with SplitKV(), SDPACalls() as calls:
                logits = model.logits_at(token, input_pos, cache, pad)[:, -1]           # (2, vocab)
            reference = naive.logits_at(token, input_pos, same_cache, pad)[:, -1]
            torch.testing.assert_close(logits, reference, atol=1e-5, rtol=0)
            assert torch.equal(logits.argmax(-1), reference.argmax(-1)) and not calls.made
            cache.advance(1)
            token = logits.argmax(-1, keepdim=True)                                   # (2, 1)


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANTS.keys())
def test_split_kv_attention_in_bf16_at_gpt2_width_is_within_bf16_rounding(variant):
    """GPT-2 small width in bf16, batch 4, a full cache of random numbers: the step's logits with
    split-KV attention as far from the naive backend's as SDPA's are, give or take half (bf16
    rounding through 12 layers: a relative norm of ~1.2% for both on a CPU's references)."""
    split_error, sdpa_error = split_kv_and_sdpa_errors(variant, compiled=False)
    assert split_error <= 1.5 * sdpa_error and sdpa_error < 3e-2, (split_error, sdpa_error)


def test_split_kv_inside_a_compiled_step_in_bf16_at_gpt2_width_is_within_bf16_rounding():
    """As above for MHA, the step compiled with inductor: 48 rows (4 x 12 heads), so its decoding
    kernel runs the configuration of model.attention.decode_kernel_options (tiles of 128 keys, 3
    stages), not the one tuned for its shape."""
    split_error, sdpa_error = split_kv_and_sdpa_errors("MHA", compiled=True)
    assert split_error <= 1.5 * sdpa_error and sdpa_error < 3e-2, (split_error, sdpa_error)


def split_kv_and_sdpa_errors(variant: str, compiled: bool) -> tuple[float, float]:
    """(split-KV's, SDPA's) relative distance from the naive backend's logits, as the tests above say."""
    model = variant_model(VARIANTS[variant], CUDA, torch.bfloat16, smoke=False)
    naive = GPT(dataclasses.replace(model.config, attn_backend="naive")).to(CUDA, torch.bfloat16).eval()
    naive.pad_head_rows().load_state_dict(model.state_dict())  # (the model's head is padded, as decoding's)
    cache = model.new_kv_cache(4)
    for t in cache.buffers:
        t.normal_(generator=torch.Generator(CUDA).manual_seed(0))
    token, pad = torch.arange(1, 5, device=CUDA)[:, None], torch.zeros(4, dtype=torch.long, device=CUDA)
    input_pos = torch.tensor([cache.max_len - 1], device=CUDA)
    logits_at = torch.compile(model.logits_at, fullgraph=True) if compiled else model.logits_at
    with torch.no_grad():
        reference = naive.logits_at(token, input_pos, cache, pad).float()
        with SplitKV():
            split = logits_at(token, input_pos, cache, pad).float()
        with sdpa_kernel(decode_backends(CUDA), set_priority=True):
            sdpa = model.logits_at(token, input_pos, cache, pad).float()
    return tuple(float((logits - reference).norm() / reference.norm()) for logits in (split, sdpa))


def test_the_compiled_step_at_batch_16_gives_the_eager_steps_tokens(float32_matmuls):
    """float32, greedy, 16 rows of prompts of 1 to 16 tokens (left-padded; refilled past the block of
    24): the inductor step (16 x 2 K/V heads: split-KV in decode_kernel_options' configuration)
    gives the eager step's tokens."""
    model = tiny_model(pos_emb="rope", **split_kv_wide({"n_kv_head": 2})).to(CUDA)
    step = CompiledDecodeStep(model, batch_size=16, backend="inductor")
    prompts = [torch.randint(1, 37, (n,), generator=torch.Generator().manual_seed(n)).to(CUDA)
               for n in range(1, 17)]
    outs = [generate(model, prompts, 20, temperature=0, decode_step=step_or_eager)
            for step_or_eager in (step, None)]
    assert all(torch.equal(a, b) for a, b in zip(*outs)), [a.tolist() for a in outs[0]]


def test_a_model_decoding_on_cuda_has_a_padded_head_and_the_unpadded_heads_tokens(float32_matmuls):
    """for_decoding pads the head's rows on CUDA to a multiple of 64 (GPT-2's 50,257 to 50,304, for
    cuBLAS's aligned kernels): float32, the inductor step's greedy tokens are the unpadded model's
    eager ones, and its logits along them within 1e-5."""
    model = tiny_model(pos_emb="rope", vocab_size=50257, **split_kv_wide({"n_kv_head": 2})).to(CUDA)
    padded = for_decoding(copy.deepcopy(model), CUDA, Precision("float32", None))
    assert padded.lm_head.weight.size(0) == 50304 and padded.wte.weight is padded.lm_head.weight
    prompt = torch.arange(1, 8, device=CUDA)[None]                       # (1, 7)
    with torch.no_grad():
        tokens = generate(model, prompt, 16, temperature=0)              # (1, 23)
        step = CompiledDecodeStep(padded, backend="inductor")
        assert torch.equal(generate(padded, prompt, 16, temperature=0, decode_step=step), tokens)
        torch.testing.assert_close(padded(tokens), model(tokens), atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", ["cuda_graph", "inductor"])
def test_the_cuda_step_draws_inside_its_graph_what_sampling_after_it_draws(backend):
    """Each way of sampling (temperature, top-k, top-p; a generator, CUDA's default one, a list of
    one per row), batch 2: the static step (as generate.py builds it: split-KV with inductor, SDPA's
    kernel in the CUDA-graph step), which draws inside its CUDA graph (one graph launch a token),
    gives the eager step's tokens; the generator ends where the eager draws leave it."""
    model = tiny_model(pos_emb="rope", **split_kv_wide({"n_kv_head": 2})).to(CUDA)
    step = CompiledDecodeStep(model, batch_size=2, backend=backend)
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]], device=CUDA)
    for kw in ({"temperature": 0}, {"temperature": 0.8, "top_k": 5}, {"temperature": 1.2, "top_p": 0.9}):
        for generators in ("one", "default", "per row"):
            outs, ends = [], []
            for decode_step in (step, None):
                torch.cuda.manual_seed(7)
                generator = {"one": torch.Generator(CUDA).manual_seed(7), "default": None,
                             "per row": [torch.Generator(CUDA).manual_seed(i) for i in (7, 8)]}[generators]
                outs.append(generate(model, prompt, 25, decode_step=decode_step, generator=generator, **kw))
                end = torch.cuda.get_rng_state() if generator is None else torch.empty(0)
                ends.append(end if not isinstance(generator, torch.Generator) else generator.get_state())
            assert torch.equal(outs[0], outs[1]), (kw, generators)
            assert torch.equal(ends[0], ends[1]), (kw, generators, "generator state")


def assert_cached_logits_close(model, tokens, length: int) -> None:
    """Along tokens (1, T), from its first `length` on, while they fit in block_size: the logits the
    cache gives a token at a time against the uncached forward's, within 1e-5 (float32)."""
    end, cache = min(tokens.size(1), model.config.block_size), model.new_kv_cache(1)
    with torch.no_grad(), sdpa_kernel(decode_backends(CUDA), set_priority=True):  # as `stream` runs them
        cached = [model(tokens[:, :length], kv_cache=cache)[0, -1]]
        cached += [model(tokens[:, t:t + 1], kv_cache=cache)[0, -1] for t in range(length, end - 1)]
        uncached = [model(tokens[:, :t])[0, -1] for t in range(length, end)]
    torch.testing.assert_close(torch.stack(cached), torch.stack(uncached), atol=1e-5, rtol=0)


def test_torchrun_with_more_processes_than_gpus_is_one_line(tmp_path):
    n = torch.cuda.device_count() + 1
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             f"--nproc_per_node={n}", str(ROOT / "train.py"), "model=tiny",
                             f"hydra.run.dir={tmp_path}/run"], cwd=tmp_path, env=clean_env(),
                            capture_output=True, text=True, timeout=300)
    output = result.stdout + result.stderr
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(errors) == 1, output[-4000:]  # (on an H200: none, exit 1)
    assert f"--nproc_per_node={n} starts {n} processes" in errors[0]
    assert f"{n - 1} CUDA device" in errors[0] and "(or train.device=cpu)" in errors[0]
    assert not (tmp_path / "run").exists()


def test_mfus_peak_is_read_from_this_gpus_name():
    name = torch.cuda.get_device_name()
    if not any(model in name for model, _ in PEAK_BF16_TFLOPS):
        pytest.skip(f"{name} has no peak in PEAK_BF16_TFLOPS (train.peak_tflops sets it)")
    assert Throughput(1, CUDA).peak_flops == peak_tflops(name) * 1e12 > 0


def test_batched_muon_on_cuda_steps_as_torch_muon():
    """bf16 Newton-Schulz batched by shape against PyTorch's per matrix: bit for bit on a CPU; on
    CUDA the kernels may sum in another order, so within a small part of the update's size."""
    torch.manual_seed(0)
    shapes = [(384, 1152)] * 3 + [(384, 384)]  # the recipe's: stacks of 3 and of 1
    params = [torch.nn.Parameter(torch.randn(shape, device=CUDA)) for shape in shapes]
    copies = [torch.nn.Parameter(p.detach().clone()) for p in params]
    kw = dict(lr=0.02, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")
    ours, theirs = BatchedMuon(params, **kw), torch.optim.Muon(copies, **kw)
    for _ in range(3):
        for p, c in zip(params, copies):
            p.grad = torch.randn_like(p)
            c.grad = p.grad.clone()
        ours.step()
        theirs.step()
    for p, c in zip(params, copies):
        step = kw["lr"] * 0.2 * max(p.shape) ** 0.5
        assert (p - c).abs().max() < 0.05 * step


def steps_of(graph: bool, compile, n: int = 6):
    """n steps of the recipe's step (bf16 autocast, clipping, fused AdamW, a changing learning rate,
    2 micro-batches) from the same weights and batches: (the losses, the weights after)."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=65, block_size=64, n_layer=2, n_head=4, n_embd=64, pos_emb="rope")
    model = GPT(config).to(CUDA)
    if compile == "blocks":
        for block in model.blocks:
            block.compile()
    optimizer = configure_optimizer(model, "adamw", 1e-3, (0.9, 0.99), 0.1)
    batches = Batches(torch.randint(0, 65, (10_000,)).numpy(), 64, 8, device=CUDA, seed=0)
    cfg = SimpleNamespace(grad_accum=2, grad_clip=1.0, batch_size=8)
    amp = torch.autocast("cuda", torch.bfloat16, cache_enabled=False)
    step = TrainStep(model, model, optimizer, batches, cfg, amp, slice(None), graph=graph)
    losses = [step(1e-3 * (i + 1)).item() for i in range(n)]
    return losses, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("compile", [False, "blocks"])
def test_the_training_step_as_a_cuda_graph_trains_as_the_step_run_as_written(compile):
    """No dropout: the graph replays the kernels the step runs (AdamW's with the learning rate read
    from a tensor, not passed as a number), so the same losses and weights to float rounding; its
    warm-up leaves no trace (the first loss is the eager first loss, from the same weights)."""
    (eager_losses, eager_weights), (graph_losses, graph_weights) = (steps_of(g, compile)
                                                                    for g in (False, True))
    torch.testing.assert_close(graph_losses, eager_losses, rtol=1e-4, atol=0)
    for a, b in zip(graph_weights, eager_weights):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


# The tiny run of conftest, on the corpus the GPU plan carries prepared (.gpu/data: the GPU machine
# has no `datasets` to prepare it), with AdamW (the CPU recipe's Muon is never graphed).
TINY_RUN = ["experiment=shakespeare_char_cpu", "model=tiny", "train.batch_size=4", "train.eval_interval=4",
            "train.eval_iters=2", "train.log_interval=1", "train.warmup_iters=2", "train.sample_tokens=0",
            "train.full_val=false", "train.optimizer=adamw", "train.compile=false",
            f"data.cache_dir={ROOT / '.gpu' / 'data'}"]


def test_a_run_with_the_cuda_graph_step_resumes_and_samples_without_a_warning_in_the_text(tmp_path):
    """The loop with train.cuda_graph (auto on CUDA): it trains, its checkpoint resumes, and
    `python generate.py dtype=float32 compile=true` on it prints the sample with nothing (inductor's
    TF32 advice) inside its text, stderr and stdout together as a terminal shows them."""
    run = train_checked(compose(*TINY_RUN, "train.max_iters=8"), tmp_path / "a")
    assert run["step"] == 8
    resumed = train_checked(compose(*TINY_RUN, f"train.resume={tmp_path / 'a'}", "train.max_iters=12"),
                            tmp_path / "b")
    assert resumed["step"] == 12
    result = subprocess.run([sys.executable, "generate.py", f"ckpt={tmp_path / 'a'}", "dtype=float32",
                             "compile=true", "prompt=ROMEO:", "max_new_tokens=40"], cwd=ROOT, env=clean_env(),
                            timeout=300,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert result.returncode == 0, result.stdout[-3000:]
    sample = result.stdout[result.stdout.index("ROMEO:"):]
    assert "Warning" not in sample and len(sample) >= 46, result.stdout[-3000:]
