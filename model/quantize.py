"""Weight-only int8 quantization for decoding (as in gpt-fast): each Linear's weight becomes int8
with one scale per output row; activations stay in the model's dtype. A decode step reads every
weight once per token, so 4x fewer weight bytes than fp32 is up to 4x fewer bytes to move."""

import torch
import torch.nn as nn


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scales = weight.abs().amax(dim=1).clamp(min=1e-8) / 127.0       # (out,)
        self.register_buffer("weight", (weight / scales[:, None]).round().to(torch.int8))
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x):
        shape = x.shape                                                   # (..., in)
        out = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]), self.weight,
                                        self.scales.to(x.dtype))      # (B*T, out)
        out = out.view(*shape[:-1], self.out_features)                    # (..., out)
        return out if self.bias is None else out + self.bias.to(x.dtype)


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear of the model (the LM head included) with an Int8Linear, in place."""
    for name, child in model.named_children():
        if isinstance(child, nn.Linear):
            setattr(model, name, Int8Linear(child))
        else:
            quantize_int8(child)
    return model
