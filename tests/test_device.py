"""model/device.py: device names (CPU, CUDA, MPS), precisions, the processes a torchrun job may
start, the torchrun helpers in one process, MFU's peak by GPU name."""

import re

import pytest
import torch

from cli.errors import naming
from model.device import Precision, pick_device
from training.distributed import check_processes
from training.throughput import Throughput, autocast, peak_tflops


def test_pick_device_names_the_option():
    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match=r"^train\.device='gpu' is not one of auto, cpu, cuda, cuda:N, mps"):
        with naming("train.device", "device"):
            pick_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device=cuda but CUDA is not available"):
            pick_device("cuda")


def test_precisions():
    cpu = torch.device("cpu")
    with autocast(cpu, "auto"):
        assert not torch.is_autocast_enabled("cpu")
    with autocast(cpu, "bfloat16"):
        assert torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize("device,dtype,quantize,n_params,expected", [
    ("cpu", "auto", "auto", 10_000_000, ("bfloat16", "int8")),  # bandwidth-bound: int8 weights
    ("cpu", "auto", "auto", 800_000, ("float32", None)),        # overhead-bound: the exact path
    ("cpu", "float32", "auto", 10_000_000, ("float32", None)),  # float32 typed: exact, never int8
    ("cpu", "bfloat16", "auto", 10_000_000, ("bfloat16", "int8")),
    ("cpu", "auto", None, 10_000_000, ("float32", None)),
    ("cpu", "auto", "int8", 800_000, ("bfloat16", "int8")),     # int8 asked for: bf16 activations
    ("cpu", "float32", "int8", 800_000, ("float32", "int8")),
    ("cuda", "auto", "auto", 10_000_000, ("bfloat16", None)),
    ("mps", "auto", "auto", 10_000_000, ("float32", None)),      # MPS: float32, no int8 weights
    ("mps", "bfloat16", "auto", 10_000_000, ("bfloat16", None)),
])
def test_precision_auto_picks_by_device_and_size_and_keeps_what_is_typed(
        device, dtype, quantize, n_params, expected):
    assert Precision(dtype, quantize).on(torch.device(device), n_params) == expected


@pytest.mark.parametrize("device,dtype,quantize,message", [
    ("cpu", "float16", "auto", "dtype must be one of auto"),
    ("cpu", "auto", "int4", "quantize must be null, auto or int8"),
    ("cuda", "auto", "int8", "quantize=int8 is for CPUs, not cuda"),  # PyTorch's reference kernel on CUDA
    ("mps", "auto", "int8", "quantize=int8 is for CPUs, not mps"),
])
def test_precision_names_the_option(device, dtype, quantize, message):
    with pytest.raises(ValueError, match=message):
        Precision(dtype, quantize).on(torch.device(device))


def test_throughput_windows_skip_the_first_step_and_evaluations():
    speed = Throughput(tokens_per_step=1000, device=torch.device("cpu"))
    times = iter([10.0, 12.0, 13.0, 20.0, 22.0])
    speed.clock = lambda: next(times)
    speed.restart()                              # the evaluation at step 0: no window yet
    assert speed.read() == (None, None)
    speed.step_done()                            # the first step (a compile): the window opens at 10
    assert speed.read() == (None, None)          # no step of it has ended: nothing measured, still open
    speed.step_done()
    speed.step_done()
    assert speed.read() == (1000.0, None)        # 2 steps in 12 - 10 s; MFU needs a peak
    speed.step_done()
    assert speed.read() == (1000.0, None)        # 1 step in 13 - 12 s: each reading opens a new window
    speed.step_done()                            # (before an evaluation: not read, not counted)
    speed.restart()                              # an evaluation ends at 20
    speed.step_done()
    speed.step_done()
    assert speed.read() == (1000.0, None)        # 2 steps in 22 - 20 s


@pytest.mark.parametrize("world_size", [1, 2, 8])
def test_mfu_is_per_device(world_size):
    """tokens/s counts every process's tokens; each device's share of them against one peak."""
    speed = Throughput(tokens_per_step=4000 * world_size, device=torch.device("cpu"), flops_per_token=1e9,
                       world_size=world_size, peak_flops=1e13)
    times = iter([0.0, 1.0])
    speed.clock = lambda: next(times)
    speed.step_done()
    speed.step_done()
    tokens_per_s, mfu = speed.read()
    assert tokens_per_s == 4000 * world_size
    assert mfu == pytest.approx(4000 * 1e9 / 1e13)  # 40% on each device, whatever their number


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has MPS")
def test_mps_is_a_device_name_and_its_absence_one_line():
    with pytest.raises(ValueError, match=r"^device=mps but PyTorch's MPS backend is not available here"):
        pick_device("mps")


def test_mps_trains_in_float32_without_autocast_unless_asked():
    mps = torch.device("mps")
    assert isinstance(autocast(mps, "auto"), type(autocast(torch.device("cpu"), "float32")))
    assert isinstance(autocast(mps, "bfloat16"), torch.autocast)


@pytest.mark.parametrize("device,processes,cuda_devices,message", [
    ("cuda", 2, 1, "torchrun --nproc_per_node=2 starts 2 processes on this machine, which has 1 CUDA device: "
                   "one process per GPU, so --nproc_per_node=1 at most"),
    ("cuda", 9, 8, "which has 8 CUDA devices"),
    ("cuda", 3, 0, "which has 0 CUDA devices"),
    ("mps", 2, 0, "torchrun --nproc_per_node=2 with device=mps: MPS has no process-group backend"),
])
def test_a_torchrun_job_needs_one_gpu_per_process(device, processes, cuda_devices, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        check_processes(torch.device(device), processes, cuda_devices)


@pytest.mark.parametrize("device,processes,cuda_devices", [
    ("cuda", 1, 1), ("cuda", 8, 8), ("cpu", 16, 0), ("cpu", 2, 1), ("mps", 1, 0)])
def test_a_torchrun_job_that_fits_its_devices_passes(device, processes, cuda_devices):
    check_processes(torch.device(device), processes, cuda_devices)


@pytest.mark.parametrize("name,tflops", [
    ("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 NVL", 835.0),
    ("NVIDIA H200", 989.0), ("NVIDIA H200 NVL", 835.0), ("NVIDIA A100-SXM4-80GB", 312.0),
    ("NVIDIA L4", None), ("", None)])
def test_mfus_peak_is_read_from_the_gpus_name(name, tflops):
    assert peak_tflops(name) == tflops


def test_mfu_needs_a_peak_off_cuda():
    assert Throughput(1, torch.device("cpu")).peak_flops is None
    assert Throughput(1, torch.device("cpu"), peak_flops=1e12).peak_flops == 1e12  # train.peak_tflops
