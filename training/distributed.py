"""The processes of a torchrun job: whether they fit the machine, joining and leaving the process
group, averaging and gathering across them, and printing from the first."""

import atexit
import gc
import os

import torch
import torch.distributed as dist
from tqdm import tqdm


def check_processes(device: torch.device, processes: int, cuda_devices: int) -> None:
    """A torchrun job's `processes` on this machine (--nproc_per_node) fit its devices: one CUDA
    device each (NCCL), any number on the CPU (gloo), and none beside the first on MPS, which has
    no process-group backend."""
    if processes > 1 and device.type == "mps":
        raise ValueError(f"torchrun --nproc_per_node={processes} with device=mps: MPS has no "
                         f"process-group backend (NCCL is CUDA's, gloo the CPU's); run one process")
    if device.type == "cuda" and processes > cuda_devices:
        raise ValueError(f"torchrun --nproc_per_node={processes} starts {processes} processes on this "
                         f"machine, which has {cuda_devices} CUDA device{'s' * (cuda_devices != 1)}: one "
                         f"process per GPU, so --nproc_per_node={cuda_devices} at most (or device=cpu)")


def print0(message: str) -> None:
    """Print from the first process only (under torchrun every process runs the same code)."""
    if int(os.environ.get("RANK", 0)) == 0:
        tqdm.write(message)


def init_distributed(device: torch.device) -> tuple[int, int, torch.device]:
    """(rank, world_size, device) of a training process. Under torchrun: one process group (NCCL on
    GPU, gloo on CPU), each process on its own GPU. Otherwise (0, 1, device). On CUDA, float32
    matmuls (those bf16 autocast leaves, or all with dtype=float32) run in TF32. The group lasts
    until the process exits (end_distributed); a second train() in the process uses it again."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # (its new-API form breaks inductor's getters)
    if not ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return 0, 1, device
    if device.type == "cuda":
        device = torch.device(f"cuda:{int(os.environ['LOCAL_RANK'])}")
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
        atexit.register(end_distributed)
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), device


def end_distributed() -> None:
    """Leave the process group, at exit, once the DDP wrappers are gone. Not sooner: a DDP wrapper
    holds the group, and one collected after the group was destroyed frees it while holding the
    GIL, joining gloo threads that wait for the GIL (a process that never exits). The scripts freeze
    the collector as they exit (gc.freeze: no last pass over torch's objects), so what it set aside is
    collected here first: a wrapper left among it outlives its group (a process that aborts at exit)."""
    gc.unfreeze()
    gc.collect()  # a wrapper in a reference cycle, while its group lives
    if dist.is_initialized():
        dist.destroy_process_group()


def mean_over_ranks(value: torch.Tensor) -> torch.Tensor:
    """The mean of `value` over the processes of a torchrun job; itself in a single process."""
    if dist.is_initialized():
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return value


def gather_from_ranks(obj) -> list:
    """[obj] of every process of a torchrun job, in rank order; [obj] in a single process."""
    if not dist.is_initialized():
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered
