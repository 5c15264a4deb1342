"""A checkpoint loaded to decode: its GPT in eval mode, on its device, in its decoding precision.

    model, ckpt = load_model("outputs/<run>")  # a run dir's best.pt, a checkpoint, a Hugging Face folder
    model, ckpt = load_model("SmolLM2-135M-Instruct.Q4_1.gguf")  # a GGUF file (model/gguf.py)
"""

import dataclasses
from pathlib import Path

from model.checkpoint import Checkpoint, is_pretrained, load, load_weights, pretrained_checkpoint
from model.device import AUTO_PRECISION, DTYPES, Precision, on_meta, pick_device
from model.gguf import gguf_config, is_gguf, read_gguf
from model.gpt import GPT
from model.pretrained import folder_config, folder_dtype
from model.quantize import quantize_int8


def load_model(path, device="auto", precision: Precision = AUTO_PRECISION):
    """A checkpoint's GPT ready to decode, and the checkpoint: `path` is a checkpoint file, a run
    dir (its best.pt, else ckpt.pt), a Hugging Face model folder (GPT.from_pretrained) or a GGUF
    file (read_gguf; the checkpoint holds the decoding model's weights); the model is on `device`,
    in eval mode, in the precision `for_decoding` gives it (a pretrained model's own, by default)."""
    gguf = is_gguf(path)
    if gguf or is_pretrained(path):  # read in the dtype it decodes in: weights are not held twice
        path = Path(path).expanduser()
        device = pick_device(device) if isinstance(device, str) else device
        own_dtype = "float32" if gguf else folder_dtype(path)  # (a GGUF's weights: dequantized to float32)
        with on_meta():
            n_params = GPT(gguf_config(path) if gguf else folder_config(path)[1]).num_params()
        dtype = DTYPES[precision.on(device, n_params, own_dtype)[0]]
        model = read_gguf(path, dtype) if gguf else GPT.from_pretrained(path, dtype=dtype)
        model = for_decoding(model, device, precision, own_dtype)
        if gguf:  # its tokenizer, chat template and end-of-text ids are in its metadata (data.gguf)
            meta = {"tokenizer": "hf", "path": str(path), "vocab": None, "vocab_size": None}
            return model, Checkpoint(model=model.state_dict(), model_config=model.config, data_meta=meta)
        return model, pretrained_checkpoint(model, path)
    ckpt = load(path, prefer="best.pt")
    model = GPT(dataclasses.replace(ckpt.model_config, dropout=0.0))  # decoding drops nothing out
    load_weights(model, ckpt.model)
    return for_decoding(model, device, precision), ckpt


def for_decoding(model, device="auto", precision: Precision = AUTO_PRECISION, own_dtype: str | None = None):
    """The model in eval mode, without gradients, on `device`, in the precision `precision` means
    there for it (int8 weights when it says so; `own_dtype`: a pretrained model's, Precision.on). (A
    weight that requires a gradient costs every matrix product a CPU decode makes ~2 µs more,
    inference mode or not.) On CUDA its output layer's rows are padded to a multiple of 64
    (GPT.pad_head_rows: cuBLAS's aligned kernels)."""
    device = pick_device(device) if isinstance(device, str) else device
    dtype, quantize = precision.on(device, model.num_params(), own_dtype)
    if quantize == "int8":
        quantize_int8(model)
    model = model.to(device=device, dtype=DTYPES[dtype]).eval().requires_grad_(False)
    return model.pad_head_rows() if device.type == "cuda" else model
