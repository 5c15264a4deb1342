"""model/device.py: device names (CPU, CUDA, MPS), the precision a model decodes in, and models built
on the meta device."""


import pytest
import torch

from model import GPT
from model.device import Precision, check_device, on_meta, pick_device
from tests.helpers import tiny_config


def test_pick_device_names_the_option():
    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device("auto").type == ("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match=r"^device='gpu' is not one of auto, cpu, cuda, cuda:N, mps"):
        pick_device("gpu")
    with pytest.raises(ValueError, match=r"^train\.device='gpu' is not one of"):  # a config's name for it
        check_device("gpu", "train.device")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device=cuda but CUDA is not available"):
            pick_device("cuda")


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


@pytest.mark.parametrize("device,dtype,quantize,own,expected", [
    ("cpu", "auto", "auto", "bfloat16", ("float32", None)),   # a real model's own answers: no lossy flag
    ("cpu", "auto", "auto", "float32", ("float32", None)),
    ("cuda", "auto", "auto", "bfloat16", ("bfloat16", None)),  # its own dtype where the device runs it well
    ("cuda", "auto", "auto", "float16", ("float32", None)),
    ("cuda", "auto", "auto", "float32", ("float32", None)),
    ("mps", "auto", "auto", "bfloat16", ("float32", None)),
    ("cpu", "auto", "int8", "bfloat16", ("bfloat16", "int8")),  # lossy when asked: as for ours
    ("cpu", "bfloat16", "auto", "float32", ("bfloat16", None)),
])
def test_a_pretrained_model_decodes_in_its_own_precision_unless_asked(device, dtype, quantize, own, expected):
    assert Precision(dtype, quantize).on(torch.device(device), 135_000_000, own) == expected


def test_a_bfloat16_hugging_face_folder_loads_in_float32_on_a_cpu(hf_folders, tmp_path):
    import json
    import shutil

    from model.loading import load_model

    shutil.copytree(hf_folders["qwen3"][0], tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps(config | {"dtype": "bfloat16"}))
    assert load_model(tmp_path / "m", "cpu")[0].wte.weight.dtype == torch.float32
    assert load_model(tmp_path / "m", "cpu", Precision("bfloat16"))[0].wte.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("device,dtype,quantize,message", [
    ("cpu", "float16", "auto", "dtype must be one of auto"),
    ("cpu", "auto", "int4", "quantize must be null, auto or int8"),
    ("cuda", "auto", "int8", "quantize=int8 is for CPUs, not cuda"),  # PyTorch's reference kernel on CUDA
    ("mps", "auto", "int8", "quantize=int8 is for CPUs, not mps"),
])
def test_precision_names_the_option(device, dtype, quantize, message):
    with pytest.raises(ValueError, match=message):
        Precision(dtype, quantize).on(torch.device(device))


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has MPS")
def test_mps_is_a_device_name_and_its_absence_one_line():
    with pytest.raises(ValueError, match=r"^device=mps but PyTorch's MPS backend is not available here"):
        pick_device("mps")


@pytest.mark.parametrize("overrides", [{}, {"pos_emb": "rope", "n_kv_head": 1}, {"mla_latent_dim": 8}])
def test_a_model_built_on_meta_has_every_shape_and_nothing_else(overrides):
    """on_meta: every parameter and buffer a model has, in its shape and dtype, on the meta device
    (no memory, no values drawn); the random numbers of a model built after it are those of one built
    without it; outside it, init works as before."""
    torch.manual_seed(0)
    with on_meta():
        shapes = GPT(tiny_config(**overrides))
    real = GPT(tiny_config(**overrides))
    assert {k: (v.shape, v.dtype) for k, v in shapes.state_dict().items()} == \
        {k: (v.shape, v.dtype) for k, v in real.state_dict().items()}
    assert all(v.is_meta for v in shapes.state_dict().values())
    torch.manual_seed(0)
    again = GPT(tiny_config(**overrides))
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in real.state_dict().items())
    assert real.wte.weight.std() > 0.01 and torch.nn.init.normal_(torch.zeros(4)).abs().sum() > 0
