"""What the full GPT's positions add to the core's RoPE (model/core/attention.py): Llama 3's
frequency scaling, an MLA retrofit's chosen frequencies, and the frequencies made once and kept."""

import functools
import math

import torch

from model.core.attention import rope_angles, rope_frequencies


def scaled_rope_frequencies(head_dim: int, base: float, scaling: tuple | None = None,
                            device=None, pairs: tuple | None = None) -> torch.Tensor:
    """RoPE's head_dim/2 frequencies (the core's rope_frequencies). With Llama 3's `scaling`, the
    values of GPTConfig.rope_scaling in ROPE_SCALING_KEYS' order (factor, low, high, original): a
    wavelength longer than original / low (a pattern the model never saw whole in training) is
    stretched by `factor`, one shorter than original / high kept, and those between blended. With
    `pairs` (GPTConfig.mla_rope_pairs: an MLA retrofit's RoPE key), those indices' alone, in order."""
    inv_freq = rope_frequencies(head_dim, base, device)
    if scaling is not None:
        factor, low, high, original = scaling
        wavelength = 2 * math.pi / inv_freq
        kept = ((original / wavelength - low) / (high - low)).clamp(0, 1)  # 0: stretched ... 1: kept
        inv_freq = (1 - kept) * inv_freq / factor + kept * inv_freq
    return inv_freq if pairs is None else inv_freq[list(pairs)]


@functools.cache
def kept_rope_frequencies(head_dim: int, base: float, scaling: tuple | None = None,
                          device=None, pairs: tuple | None = None) -> torch.Tensor:
    """scaled_rope_frequencies, made once and kept, outside inference mode (for a backward pass)."""
    with torch.inference_mode(False):
        return scaled_rope_frequencies(head_dim, base, scaling, device, pairs)


def rope_at(positions: torch.Tensor, head_dim: int, base: float = 10000.0, scaling: tuple | None = None,
            pairs: tuple | None = None):
    """The core's rope_angles at `positions` from the kept frequencies (a compiled graph computes them)."""
    frequencies = scaled_rope_frequencies if torch.compiler.is_compiling() else kept_rope_frequencies
    return rope_angles(positions, frequencies(head_dim, base, scaling, positions.device, pairs))
