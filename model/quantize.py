"""Weight-only int8 quantization of the core GPT's Linear layers for decoding (as in gpt-fast): one scale
per output row, activations in the model's dtype. A decode step reads every weight once per token: up to
4x fewer bytes than fp32.

Why the padding: the CPU kernel torch._weight_int8pack_mm (PyTorch 2.13) reads the input width K in
vectors of 8 (AVX2, ARM) or 16 (AVX512) with no remainder loop, and on x86 with aligned loads (x86
vectorizes bf16 only, ARM every dtype). Another K, or a row of x off a 16-byte (AVX512: 32) boundary,
gives garbage (~1e34) or a segfault. So the weight's K is zero-padded to a multiple of 16 and x padded
to match, a fresh, aligned tensor. (No dequantizing fallback: inductor rewrites it into the same kernel.)
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

K_MULTIPLE = 16  # the kernel's widest vector (AVX512: 16 bf16): every CPU's loop then ends at K
ALIGN_BYTES = 32  # AVX512's aligned 256-bit load of 16 bf16


class Int8Linear(nn.Module):
    """nn.Linear with an int8 weight and one scale per output row; in_features is the unpadded width."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()                          # (out, in)
        scales = weight.abs().amax(dim=1).clamp(min=1e-8) / 127.0       # (out,)
        int8 = (weight / scales[:, None]).round().to(torch.int8)        # (out, in)
        padded_in = -(-self.in_features // K_MULTIPLE) * K_MULTIPLE
        self.register_buffer("weight", F.pad(int8, (0, padded_in - self.in_features)))  # (out, padded_in)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def forward(self, x):
        shape = x.shape                                                   # (..., in)
        x = x.reshape(-1, self.in_features)                               # (B*T, in)
        pad = self.weight.size(1) - self.in_features
        if pad:
            x = F.pad(x, (0, pad))                          # (B*T, padded_in), fresh and aligned
        elif not torch.compiler.is_compiling() and not aligned(x):
            # A misaligned view (a slice of the last dim) faults the kernel. Compiled graphs skip this
            # (data_ptr is not traceable, and inductor drops the copy as a no-op): no GPT layer makes one.
            x = x.clone(memory_format=torch.contiguous_format)          # (B*T, in)
        out = torch._weight_int8pack_mm(x, self.weight, self.scales.to(x.dtype))  # (B*T, out)
        out = out.view(*shape[:-1], self.out_features)                    # (..., out)
        return out if self.bias is None else out + self.bias.to(x.dtype)

    def dequantized(self) -> torch.Tensor:
        """The weight this layer multiplies by, in fp32: int8 times scale, (out, in)."""
        return self.weight[:, :self.in_features].float() * self.scales.float()[:, None]

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")


def aligned(x: torch.Tensor) -> bool:
    """Every row of x (M, K), K a multiple of 16, starts where the kernel's aligned loads can."""
    return x.is_contiguous() and x.data_ptr() % ALIGN_BYTES == 0


def quantize_int8(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear of the model (the LM head included) with an Int8Linear, in place."""
    for name, child in model.named_children():
        if isinstance(child, nn.Linear):
            setattr(model, name, Int8Linear(child))
        else:
            quantize_int8(child)
    return model
