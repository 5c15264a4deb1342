"""model/device.py: device names, precisions, the torchrun helpers in one process."""

import pytest
import torch

from model.command_line import naming
from model.device import autocast, decode_precision, pick_device


def test_pick_device_names_the_option():
    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match=r"^train\.device='mps' is not one of auto, cpu, cuda"):
        with naming("train.device", "device"):
            pick_device("mps")
    with pytest.raises(ValueError, match=r"device='gpu' is not one of"):
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
])
def test_decode_precision_auto_picks_by_device_and_size_and_keeps_what_is_typed(
        device, dtype, quantize, n_params, expected):
    assert decode_precision(torch.device(device), dtype, quantize, n_params) == expected


@pytest.mark.parametrize("dtype,quantize,message", [("float16", "auto", "dtype must be one of auto"),
                                                    ("auto", "int4", "quantize must be null, auto or int8")])
def test_decode_precision_names_the_option(dtype, quantize, message):
    with pytest.raises(ValueError, match=message):
        decode_precision(torch.device("cpu"), dtype, quantize)
