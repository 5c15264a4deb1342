"""The CUDA checks, run with `pytest --gpu tests/test_gpu.py` (the GPU plan's last command; without
--gpu they are skipped and the suite hides CUDA): the decode step gets a fused SDPA kernel for every
attention variant and gives the eager and uncached paths' tokens on CUDA, the training step gets
flash, a torchrun job with more processes than GPUs is refused in one line, MFU's peak is read from
the GPU's name, and BatchedMuon steps as PyTorch's Muon."""

import subprocess
import sys

import pytest
import torch

from benchmarks.gpu import VARIANTS, decode_step_kernels, training_kernels, variant_model
from model import GPT, GPTConfig
from model.generation import CompiledDecodeStep, generate
from tests.helpers import ROOT, clean_env, tiny_model
from tests.model.test_generation import DECODE_VARIANTS
from training.optimizer import BatchedMuon
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


@pytest.mark.parametrize("variant", DECODE_VARIANTS, ids=DECODE_VARIANTS.keys())
def test_the_compiled_step_on_cuda_gives_the_eager_and_uncached_tokens(variant):
    """float32 (no TF32), greedy and seeded, two calls with prompts of two lengths, as on the CPU."""
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        model = tiny_model(pos_emb="rope", **DECODE_VARIANTS[variant]).to(CUDA)
        kv_dtype = torch.int8 if "int8" in variant else None
        step = CompiledDecodeStep(model, kv_dtype=kv_dtype)
        for kw in ({"temperature": 0}, {"temperature": 1.0, "top_k": 20}):
            for length in (1, 7):
                prompt = torch.arange(1, length + 1, device=CUDA)[None]          # (1, length)
                generator = lambda: torch.Generator(CUDA).manual_seed(length)  # noqa: B023
                outs = [generate(model, prompt, 30, kv_cache=cache, decode_step=decode_step,
                                 kv_dtype=kv_dtype, generator=generator(), **kw)
                        for cache, decode_step in ((True, step), (True, None), (False, None))]
                assert torch.equal(outs[0], outs[1]), (kw, length, "compiled vs eager")
                if kv_dtype is None:  # an int8 cache rounds what the uncached path keeps exact
                    assert torch.equal(outs[0], outs[2]), (kw, length, "compiled vs uncached")
    finally:
        torch.set_float32_matmul_precision(precision)


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
