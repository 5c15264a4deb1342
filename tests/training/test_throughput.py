"""training/throughput.py and training/distributed.py: throughput windows and MFU (its peak from the
GPU's name), training's autocast, and the processes a torchrun job may start."""

import re

import pytest
import torch

from training.distributed import check_processes
from training.throughput import Throughput, autocast, peak_tflops


def test_precisions():
    cpu = torch.device("cpu")
    with autocast(cpu, "auto"):
        assert not torch.is_autocast_enabled("cpu")
    with autocast(cpu, "bfloat16"):
        assert torch.is_autocast_enabled("cpu")


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
