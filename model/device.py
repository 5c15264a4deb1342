"""Where and in what precision a model runs. Here: the device a name picks (CPU, CUDA, Apple's
MPS), its memory, the precision a model decodes in, a clock that waits for the device, and the meta
device a model is built on for its shapes alone."""

import contextlib
import os
import re
import time
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def check_device(device: str, name: str = "device") -> str:
    """A device name this project runs on: auto, cpu, cuda, cuda:N or mps (whether the device is
    there is checked when it is picked); the message calls the option `name`."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?|mps", str(device)):
        raise ValueError(f"{name}={device!r} is not one of auto, cpu, cuda, cuda:N, mps")
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


def memory_bytes(device: torch.device) -> int:
    """The memory a device has: the GPU's, MPS's working set (shared with the machine), or the
    machine's RAM for the CPU."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type == "mps":
        return torch.mps.recommended_max_memory()
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


# On a CPU a decode step reads every weight once per token. Above this many parameters (16 MB in
# float32, half this CPU's L3) memory bandwidth bounds it and int8 weights pay; below it the
# per-op overhead does, and bfloat16's conversions cost more than they save (benchmarks/decode.py).
INT8_FROM_PARAMS = 4_000_000


@dataclass(frozen=True)
class Precision:
    """The precision a model decodes in, as asked: `dtype` auto, float32 or bfloat16 (weights,
    activations and by default the KV cache) and `quantize` auto, int8 (weight-only int8 Linear
    layers) or None. Checked when made, so whoever is handed one needs no second check; `on` says
    what auto means on a device."""

    dtype: str = "auto"
    quantize: str | None = "auto"

    def __post_init__(self):
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of auto, {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.quantize not in (None, "auto", "int8"):
            raise ValueError(f"quantize must be null, auto or int8, got {self.quantize!r}")

    def on(self, device: torch.device, n_params: int = 0,
           own_dtype: str | None = None) -> tuple[str, str | None]:
        """(dtype, quantize) to decode a model of n_params parameters in on `device`. A pretrained
        model (`own_dtype`: the dtype its folder declares) keeps its own answers: auto is its
        bfloat16 on CUDA, float32 elsewhere (a CPU without bfloat16 products, MPS), never int8
        weights; those, and an int8 cache, only when asked. A model of ours: auto picks the fastest
        precision whose val loss stays within 0.01 of float32's (benchmarks/decode.py measures both):
        on a CPU int8 weights with bfloat16 activations from INT8_FROM_PARAMS parameters, float32
        below; on CUDA bfloat16; on MPS float32. dtype=float32 is the exact path: quantize=auto then
        stays off. int8 weights are for CPUs, with bfloat16 activations (the kernel's vectorised path)."""
        dtype, quantize = self.dtype, self.quantize
        if quantize == "int8" and device.type != "cpu":
            raise ValueError(f"quantize=int8 is for CPUs, not {device.type} (its int8 kernel is measured "
                             f"only there; on CUDA PyTorch runs it with a slow reference kernel): use "
                             f"quantize=null")
        if own_dtype is not None:
            quantize = None if quantize == "auto" else quantize
            if dtype == "auto" and quantize != "int8":
                dtype = "bfloat16" if device.type == "cuda" and own_dtype == "bfloat16" else "float32"
        if quantize == "auto":
            big = n_params >= INT8_FROM_PARAMS
            quantize = "int8" if device.type == "cpu" and dtype in ("auto", "bfloat16") and big else None
        if dtype == "auto":
            dtype = "bfloat16" if quantize == "int8" or device.type == "cuda" else "float32"
        return dtype, quantize


AUTO_PRECISION = Precision()  # (a frozen default: one object serves every call)


def synchronized_clock(device: torch.device):
    """time.perf_counter that first waits for the device's queued work (CUDA and MPS run async)."""
    if device.type not in ("cuda", "mps"):
        return time.perf_counter
    synchronize = torch.cuda.synchronize if device.type == "cuda" else torch.mps.synchronize

    def clock():
        synchronize()
        return time.perf_counter()

    return clock


class SkipWeightInit(TorchFunctionMode):
    """Calls of torch.nn.init's functions return their tensor untouched (on the meta device it holds
    no values to fill)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else kwargs["tensor"]
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def on_meta():
    """Modules built inside are on the meta device: their shapes, no memory and no initialisation
    (a meta tensor's normal_ imports torch's compiler: a second of a command's start)."""
    with torch.device("meta"), SkipWeightInit():
        yield
