"""Where and in what precision a model runs: the device a name picks (CPU, CUDA, Apple's MPS), the
processes of a torchrun job (and printing from the first), training's autocast, the precision a
model decodes in, a clock that waits for the device, and training throughput (tokens/s, MFU, the
GPU's peak read from its name) measured with it."""

import atexit
import gc
import os
import re
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from tqdm import tqdm

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def check_device(device: str) -> str:
    """A device name this project runs on: auto, cpu, cuda, cuda:N or mps (whether the device is
    there is checked when it is picked)."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", str(device)):
        raise ValueError(f"device={device!r} is not one of auto, cpu, cuda, cuda:N, mps")
    return device


def pick_device(device: str = "auto") -> torch.device:
    """`auto` is CUDA when it is available, else the CPU (never MPS: it is asked for by name)."""
    if check_device(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    picked = torch.device(device)
    if picked.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError("device=mps but PyTorch's MPS backend is not available here (it needs Apple "
                         "Silicon and macOS 12.3 or later): use device=cpu or auto")
    if picked.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device} but CUDA is not available: use device=cpu or auto")
    if picked.type == "cuda" and picked.index is not None and picked.index >= torch.cuda.device_count():
        raise ValueError(f"device={device} but this machine has {torch.cuda.device_count()} CUDA devices")
    return picked


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


def memory_bytes(device: torch.device) -> int:
    """The memory a device has: the GPU's, MPS's working set (shared with the machine), or the
    machine's RAM for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "mps":
        return torch.mps.recommended_max_memory()
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


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
    GIL, joining gloo threads that wait for the GIL (a process that never exits)."""
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


# On a CPU a decode step reads every weight once per token. Above this many parameters (16 MB in
# float32, half this CPU's L3) memory bandwidth bounds it and int8 weights pay; below it the
# per-op overhead does, and bfloat16's conversions cost more than they save (benchmarks/decode.py).
INT8_FROM_PARAMS = 4_000_000


def decode_precision(device: torch.device, dtype: str = "auto", quantize: str | None = "auto",
                     n_params: int = 0) -> tuple[str, str | None]:
    """(dtype, quantize) to decode a model of n_params parameters in. `auto` picks the fastest
    precision whose val loss stays within 0.01 of float32's (benchmarks/decode.py measures both):
    on a CPU int8 weights with bfloat16 activations from INT8_FROM_PARAMS parameters, float32
    below; on CUDA bfloat16; on MPS float32 (int8 weights are refused on both). dtype=float32 is the
    exact path: quantize=auto then stays off. int8 runs with bfloat16 activations on a CPU (the
    kernel's vectorised path)."""
    if dtype != "auto" and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}, got {dtype!r}")
    if quantize not in (None, "auto", "int8"):
        raise ValueError(f"quantize must be null, auto or int8, got {quantize!r}")
    if quantize == "int8" and device.type != "cpu":
        raise ValueError(f"quantize=int8 is for CPUs, not {device.type} (its int8 kernel is measured only "
                         f"there; on CUDA PyTorch runs it with a slow reference kernel): use quantize=null")
    if quantize == "auto":
        big = n_params >= INT8_FROM_PARAMS
        quantize = "int8" if device.type == "cpu" and dtype in ("auto", "bfloat16") and big else None
    if dtype == "auto":
        dtype = "bfloat16" if quantize == "int8" or device.type == "cuda" else "float32"
    return dtype, quantize


def autocast(device: torch.device, dtype: str = "auto"):
    """The training precision: bf16 autocast on CUDA by default, plain float32 on the CPU and MPS."""
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    if DTYPES[dtype] == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16)


def synchronized_clock(device: torch.device):
    """time.perf_counter that first waits for the device's queued work (CUDA and MPS run async)."""
    if device.type not in ("cuda", "mps"):
        return time.perf_counter
    synchronize = torch.cuda.synchronize if device.type == "cuda" else torch.mps.synchronize

    def clock():
        synchronize()
        return time.perf_counter()

    return clock


# Dense bf16 peaks (TFLOP/s, NVIDIA's datasheets), matched in this order in the device's name:
# the NVL and PCIe cards of a generation run slower clocks than its SXM one.
PEAK_BF16_TFLOPS = (("H100 NVL", 835.0), ("H200 NVL", 835.0), ("H100 PCIe", 756.0), ("H100", 989.0),
                    ("H200", 989.0), ("A100", 312.0))  # (GH200's name holds "H200")


def peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU named `device_name` (torch.cuda.get_device_name), or None for
    one not in PEAK_BF16_TFLOPS (then MFU needs train.peak_tflops)."""
    return next((tflops for model, tflops in PEAK_BF16_TFLOPS if model in device_name), None)


class Throughput:
    """Training tokens/s and MFU (model FLOPs utilisation) over a window of steps. Each reading
    closes a window and opens the next; the first window opens when the first step (which
    compiles) ends, and `restart` (after an evaluation) opens a new one, so neither is counted.
    MFU is per device: the run's tokens/s over world_size devices of peak_flops each (by default a
    CUDA device's from its name; none on other devices)."""

    def __init__(self, tokens_per_step: int, device: torch.device, flops_per_token: float = 0.0,
                 world_size: int = 1, peak_flops: float | None = None):
        self.tokens_per_step, self.clock = tokens_per_step, synchronized_clock(device)
        self.flops_per_device = flops_per_token / world_size
        if peak_flops is None and device.type == "cuda":
            tflops = peak_tflops(torch.cuda.get_device_name(device))
            peak_flops = tflops and tflops * 1e12  # None for a GPU of unknown peak: no MFU
        self.peak_flops = peak_flops
        self.steps, self.start = None, None  # the first step has not ended

    def restart(self) -> None:
        """Open a new window now (after an evaluation), or, before the first step, when it ends."""
        if self.steps is not None:
            self.steps, self.start = 0, self.clock()

    def step_done(self) -> None:
        if self.steps is None:
            self.steps, self.start = 0, self.clock()
        else:
            self.steps += 1

    def read(self) -> tuple[float | None, float | None]:
        """(tokens/s, MFU or None without a peak) since the window opened, or (None, None) before a
        step of it ended; opens the next window."""
        if not self.steps:
            return None, None
        now = self.clock()
        tokens_per_s = self.steps * self.tokens_per_step / (now - self.start)
        self.steps, self.start = 0, now
        mfu = tokens_per_s * self.flops_per_device / self.peak_flops if self.peak_flops else None
        return tokens_per_s, mfu
