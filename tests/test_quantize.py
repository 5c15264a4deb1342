"""model/quantize.py: weight-only int8 Linear layers stay close to fp32 and generate."""

import torch

from model.quantize import Int8Linear, quantize_int8
from tests.helpers import tiny_model


def test_int8_weights_stay_close_and_generate():
    model = tiny_model(n_kv_head=2)
    idx = torch.randint(0, 37, (2, 12))
    reference = model(idx)
    quantized = quantize_int8(tiny_model(n_kv_head=2))
    assert sum(isinstance(m, Int8Linear) for m in quantized.modules()) == 2 * 4 + 1
    error = (quantized(idx) - reference).norm() / reference.norm()
    assert error < 0.02
    bf16 = quantized.to(torch.bfloat16)
    assert bf16.new_kv_cache(1).k[0].dtype == torch.bfloat16
    assert bf16.generate(idx, 5, temperature=0).shape == (2, 17)
