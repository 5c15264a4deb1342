"""Training's precision and speed: bf16 autocast on CUDA, and throughput (tokens/s, and MFU against
the GPU's dense bf16 peak, read from its name)."""

from contextlib import nullcontext

import torch

from model.device import DTYPES, synchronized_clock


def autocast(device: torch.device, dtype: str = "auto"):
    """The training precision: bf16 autocast on CUDA by default, plain float32 on the CPU and MPS.
    Without autocast's cache of cast weights: each forward casts each weight once anyway, and a
    cache that outlives a CUDA graph's capture would hand the graph's memory to later steps."""
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    if DTYPES[dtype] == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=torch.bfloat16, cache_enabled=False)


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
