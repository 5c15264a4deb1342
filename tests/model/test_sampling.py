"""model/sampling.py: greedy at temperature 0 or close to it, top-k and top-p keep what they
say, and every option is checked when a Sampling is made, naming itself."""

import pytest
import torch

from model.generation import generate
from model.sampling import Sampling, sample_next
from tests.helpers import tiny_model


def test_top_k_one_is_greedy():
    logits = torch.randn(5, 37)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(sample_next(logits, Sampling(1, 1.0, top_k=1), generator=g), logits.argmax(-1))


def test_tiny_temperature_is_greedy():
    logits = torch.randn(5, 37)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(sample_next(logits, Sampling(1, 1e-6), generator=g), logits.argmax(-1))
    model = tiny_model()
    idx = torch.randint(0, 37, (2, 4))
    assert torch.equal(generate(model, idx, 10, temperature=1e-6, generator=g),
                       generate(model, idx, 10, temperature=0))


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    g = torch.Generator().manual_seed(0)
    draws = lambda p: {sample_next(logits, Sampling(1, 1.0, top_p=p), generator=g).item() for _ in range(300)}
    assert draws(0.5) == {0}          # 0.5 alone reaches 0.5
    assert draws(0.8) == {0, 1}       # 0.5 + 0.3 reaches 0.8
    assert draws(0.81) == {0, 1, 2}
    assert draws(1.0) == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="top_p"):  # checked once, when the Sampling is made
        Sampling(1, top_p=0)


@pytest.mark.parametrize("option,value,message", [
    ("max_new_tokens", -1, "max_new_tokens must be an integer >= 0"),
    ("temperature", -0.5, "temperature must be a number >= 0"),
    ("top_k", 0, "top_k must be an integer >= 1"),
    ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
])
def test_sampling_options_name_themselves(option, value, message):
    with pytest.raises(ValueError, match=message):
        Sampling(**{"max_new_tokens": 3, option: value})
    model = tiny_model()
    with pytest.raises(ValueError, match=message):
        generate(model, torch.zeros(1, 2, dtype=torch.long), **{"max_new_tokens": 3, option: value})


@pytest.mark.parametrize("temperature", [1e-30, 1e-40, 1e-46, 5e-324])
def test_a_temperature_however_small_samples_the_most_likely_token(temperature):
    """logits / temperature would overflow to inf, and inf - inf is NaN: no temperature > 0 may."""
    logits = torch.randn(4, 37) * 10
    generator = torch.Generator().manual_seed(0)
    assert torch.equal(sample_next(logits, Sampling(1, temperature), generator=generator), logits.argmax(-1))
    model = tiny_model()
    idx = torch.randint(0, 37, (2, 3))
    assert torch.equal(generate(model, idx, 6, temperature=temperature, generator=generator),
                       generate(model, idx, 6, temperature=0))
