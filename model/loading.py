"""A checkpoint loaded to decode: its GPT in eval mode, on its device, in its decoding precision.

    model, ckpt = load_model("outputs/<run>")  # a run dir's best.pt, a checkpoint, a Hugging Face folder
"""

import dataclasses
from pathlib import Path

import torch

from model.checkpoint import is_pretrained, load, load_weights, pretrained_checkpoint
from model.device import AUTO_PRECISION, DTYPES, Precision, pick_device
from model.gpt import GPT
from model.pretrained import folder_config
from model.quantize import quantize_int8


def load_model(path, device="auto", precision: Precision = AUTO_PRECISION):
    """A checkpoint's GPT ready to decode, and the checkpoint: `path` is a checkpoint file, a run
    dir (its best.pt, else ckpt.pt) or a Hugging Face model folder (GPT.from_pretrained: the
    checkpoint holds the decoding model's weights); the model is on `device`, in eval mode, in the
    precision `for_decoding` gives it."""
    if is_pretrained(path):  # read in the dtype it decodes in: a billion parameters are not held twice
        device = pick_device(device) if isinstance(device, str) else device
        with torch.device("meta"):
            n_params = GPT(folder_config(path)[1]).num_params()
        dtype = DTYPES[precision.on(device, n_params)[0]]
        model = for_decoding(GPT.from_pretrained(Path(path).expanduser(), dtype=dtype), device, precision)
        return model, pretrained_checkpoint(model, path)
    ckpt = load(path, prefer="best.pt")
    model = GPT(dataclasses.replace(ckpt.model_config, dropout=0.0))  # decoding drops nothing out
    load_weights(model, ckpt.model)
    return for_decoding(model, device, precision), ckpt


def for_decoding(model, device="auto", precision: Precision = AUTO_PRECISION):
    """The model in eval mode, without gradients, on `device`, in the precision `precision` means
    there (int8 weights when it says so). (A weight that requires a gradient costs every matrix
    product a CPU decode makes ~2 µs more, inference mode or not.) On CUDA its output layer's rows
    are padded to a multiple of 64 (GPT.pad_head_rows: cuBLAS's aligned kernels)."""
    device = pick_device(device) if isinstance(device, str) else device
    dtype, quantize = precision.on(device, model.num_params())
    if quantize == "int8":
        quantize_int8(model)
    model = model.to(device=device, dtype=DTYPES[dtype]).eval().requires_grad_(False)
    return model.pad_head_rows() if device.type == "cuda" else model
