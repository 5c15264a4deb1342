"""model/device.py: device names, precisions, the torchrun helpers in one process."""

import pytest
import torch

from model.device import autocast, check_dtype, main_process_first, pick_device


def test_pick_device_names_the_option():
    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match=r"train\.device='mps' is not one of auto, cpu, cuda"):
        pick_device("mps", "train.device")
    with pytest.raises(ValueError, match=r"device='gpu' is not one of"):
        pick_device("gpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device=cuda but CUDA is not available"):
            pick_device("cuda")


def test_precisions():
    assert check_dtype("bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16"):
        check_dtype("float16")
    cpu = torch.device("cpu")
    with autocast(cpu, "auto"):
        assert not torch.is_autocast_enabled("cpu")
    with autocast(cpu, "bfloat16"):
        assert torch.is_autocast_enabled("cpu")


def test_main_process_first_is_a_no_op_in_one_process():
    ran = []
    with main_process_first():
        ran.append(1)
    assert ran == [1]
